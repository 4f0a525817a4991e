"""Pruning schedules: at which step masks are recomputed, at what sparsity.

The same semantics as tensorflow-model-optimization 0.8.1's
``pruning_schedule`` (read there; this is our own code), so a schedule means
the same thing here and in tfmot. A schedule is called with a step and
returns ``(should_prune, sparsity)``:

- ``should_prune``: ``begin_step <= step`` and (``step <= end_step`` or
  ``end_step == -1``, ConstantSparsity only) and ``(step - begin_step) %
  frequency == 0``; both ends inclusive.
- ``PolynomialDecay``: ``final + (initial - final) * (1 - p) ** power`` with
  ``p = clip((step - begin) / (end - begin), 0, 1)``, in float32 (tfmot's
  rounding too). If ``(end - begin) % frequency != 0`` the final sparsity is
  never applied (tfmot's behaviour, kept).
- ``ConstantSparsity``: ``target_sparsity``.

Where tfmot counts training forward passes, `tf_gradkit`'s pruning counts
real optimizer updates: the masks of step ``k`` are made before update ``k``
from the weights after update ``k - 1`` (under ``fit`` with ``model=``, before
the forward pass of step ``k``), which is what tfmot's step ``k`` does
without gradient accumulation.

Custom schedules subclass `PruningSchedule` (as tfmot's users subclass
tfmot's): pass ``begin_step``, ``end_step`` and ``frequency`` to its
``__init__`` (or override ``should_prune``), write ``sparsity(step)`` in
TensorFlow and ``get_config()``. Subclasses are registered by class name
when defined, so a saved `MagnitudePruning` finds them again on load.
"""

import tensorflow as tf

__all__ = ["PruningSchedule", "ConstantSparsity", "PolynomialDecay", "SCHEDULES", "serialize",
           "deserialize"]


def _check(owner, **values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{owner}: `{name}` must be an integer. Received: "
                             f"{name}={value!r}")


def _check_sparsity(owner, **values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0.0 <= value < 1.0:
            raise ValueError(f"{owner}: `{name}` must be a number in [0, 1). "
                             f"Received: {name}={value!r}")


# Class name -> schedule class: every subclass of PruningSchedule, at definition.
SCHEDULES = {}


class PruningSchedule:
    """The base of pruning schedules: ``(should_prune, sparsity)`` for a step.

    A subclass passes its step range to ``__init__`` (validated: integers,
    ``0 <= begin_step <= end_step`` or ``end_step == -1`` for no end,
    ``frequency >= 1``) and writes:

    - ``sparsity(step)``: a float32 scalar tensor in [0, 1), in TensorFlow
      (``step`` is an int64 scalar tensor; this runs inside ``tf.function``
      and XLA);
    - ``get_config()``: the keyword arguments of ``__init__`` (``from_config``
      calls ``cls(**config)``).

    ``should_prune(step)`` is true at ``begin_step, begin_step + frequency,
    ...`` up to ``end_step`` (both inclusive); override it for other steps.
    Subclasses register by class name (for loading a saved optimizer).

    Example:

    >>> class StepSparsity(tf_gradkit.pruning.PruningSchedule):
    ...     \"\"\"50% from step 0, 80% from step 100, masks every 10 steps.\"\"\"
    ...     def __init__(self, frequency=10):
    ...         super().__init__(begin_step=0, end_step=-1, frequency=frequency)
    ...     def sparsity(self, step):
    ...         return tf.where(step >= 100, 0.8, 0.5)
    ...     def get_config(self):
    ...         return {"frequency": self.frequency}
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        SCHEDULES[cls.__name__] = cls

    def __init__(self, begin_step, end_step, frequency, allow_no_end=True):
        owner = type(self).__name__
        _check(owner, begin_step=begin_step, end_step=end_step, frequency=frequency)
        if begin_step < 0:
            raise ValueError(f"{owner}: `begin_step` must be >= 0. Received: "
                             f"begin_step={begin_step}")
        if end_step == -1 and not allow_no_end:
            raise ValueError(f"{owner}: `end_step` must be >= `begin_step`; -1 (no "
                             f"end) is for ConstantSparsity. Received: end_step=-1")
        if end_step != -1 and end_step < begin_step:
            raise ValueError(f"{owner}: `end_step` must be >= `begin_step` (or -1 for "
                             f"no end). Received: begin_step={begin_step}, "
                             f"end_step={end_step}")
        if frequency < 1:
            raise ValueError(f"{owner}: `frequency` must be >= 1. Received: "
                             f"frequency={frequency}")
        self.begin_step, self.end_step, self.frequency = begin_step, end_step, frequency

    def should_prune(self, step):
        step = tf.cast(step, tf.int64)
        in_range = step >= self.begin_step
        if self.end_step != -1:
            in_range = tf.logical_and(in_range, step <= self.end_step)
        return tf.logical_and(in_range, tf.equal(
            tf.math.floormod(step - self.begin_step, self.frequency), 0))

    def sparsity(self, step):
        """The fraction of each weight to prune at ``step`` (a subclass's)."""
        raise NotImplementedError(f"{type(self).__name__} must define sparsity(step)")

    def __call__(self, step):
        return self.should_prune(step), self.sparsity(step)

    def get_config(self):
        """``__init__``'s keyword arguments (a subclass's)."""
        raise NotImplementedError(f"{type(self).__name__} must define get_config()")

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class ConstantSparsity(PruningSchedule):
    """``target_sparsity`` at steps ``begin_step, begin_step + frequency, ...``
    (up to ``end_step``; -1: no end). tfmot's ``ConstantSparsity``."""

    def __init__(self, target_sparsity, begin_step=0, end_step=-1, frequency=100):
        _check_sparsity("ConstantSparsity", target_sparsity=target_sparsity)
        super().__init__(begin_step, end_step, frequency, allow_no_end=True)
        self.target_sparsity = float(target_sparsity)

    def sparsity(self, step):
        del step
        return tf.constant(self.target_sparsity, tf.float32)

    def get_config(self):
        return {"target_sparsity": self.target_sparsity, "begin_step": self.begin_step,
                "end_step": self.end_step, "frequency": self.frequency}


class PolynomialDecay(PruningSchedule):
    """From ``initial_sparsity`` at ``begin_step`` to ``final_sparsity`` at
    ``end_step`` along ``(1 - p) ** power``, recomputed every ``frequency``
    steps. tfmot's ``PolynomialDecay`` (``begin_step == end_step`` is refused:
    tfmot computes a NaN sparsity there)."""

    def __init__(self, initial_sparsity, final_sparsity, begin_step, end_step, power=3,
                 frequency=100):
        _check_sparsity("PolynomialDecay", initial_sparsity=initial_sparsity,
                        final_sparsity=final_sparsity)
        super().__init__(begin_step, end_step, frequency, allow_no_end=False)
        if end_step == begin_step:
            raise ValueError("PolynomialDecay: `end_step` must be > `begin_step`. "
                             f"Received: begin_step={begin_step}, end_step={end_step}")
        if isinstance(power, bool) or not isinstance(power, (int, float)):
            raise ValueError(f"PolynomialDecay: `power` must be a number. Received: "
                             f"power={power!r}")
        self.initial_sparsity = float(initial_sparsity)
        self.final_sparsity = float(final_sparsity)
        self.power = power

    def sparsity(self, step):
        progress = tf.cast(tf.cast(step, tf.int64) - self.begin_step, tf.float32) / float(
            self.end_step - self.begin_step)
        progress = tf.minimum(1.0, tf.maximum(0.0, progress))
        return (tf.constant(self.initial_sparsity - self.final_sparsity, tf.float32)
                * tf.pow(1.0 - progress, tf.cast(self.power, tf.float32))
                + tf.constant(self.final_sparsity, tf.float32))

    def get_config(self):
        return {"initial_sparsity": self.initial_sparsity,
                "final_sparsity": self.final_sparsity, "begin_step": self.begin_step,
                "end_step": self.end_step, "power": self.power, "frequency": self.frequency}


def serialize(schedule):
    return {"class_name": type(schedule).__name__, "config": schedule.get_config()}


def deserialize(config, custom_objects=None):
    """The schedule ``serialize`` described: its class from ``custom_objects``
    or the subclasses of `PruningSchedule` defined in this process."""
    name = config["class_name"]
    cls = (custom_objects or {}).get(name) or SCHEDULES.get(name)
    if cls is None:
        raise ValueError(f"Unknown pruning schedule class {name!r}: define (import) the "
                         "PruningSchedule subclass before loading, or pass it in "
                         f"custom_objects. Known: {sorted(SCHEDULES)}")
    return cls.from_config(config["config"])
