"""A choice read while a function is traced, overridable for a block of code.

`precision.use_split` and `spd.use_kernel` are both this: "auto" lets the
module decide from the device and context when a step is traced; the other
modes force one implementation (tests use them to run a GPU or XLA path on a
CPU). The override is per thread, like TensorFlow's own tracing state.
"""

import contextlib
import threading


class TraceChoice:
    """Holds one override: ``mode`` reads it, ``use(mode)`` sets it for a block.

    Args:
      owner: the public function's name, for error messages.
      modes: the accepted modes, "auto" first.
    """

    def __init__(self, owner, modes):
        self.owner, self.modes = owner, tuple(modes)
        self._state = threading.local()

    @property
    def mode(self):
        return getattr(self._state, "mode", self.modes[0])

    @contextlib.contextmanager
    def use(self, mode):
        if mode not in self.modes:
            raise ValueError(f"{self.owner}: `mode` must be one of {self.modes}. "
                             f"Received: mode={mode!r}")
        previous = self.mode
        self._state.mode = mode
        try:
            yield
        finally:
            self._state.mode = previous
