"""Pruning masks as a value (pure TensorFlow; nothing of tfmot or Keras).

`Masks` is handed down an optimizer chain by `MaskAware`
to every optimizer that can use masks (``accepts_masks``): `Projected`
projects within the masks' support, `LevenbergMarquardt` solves for the
unpruned weights only. A `Projected` outside a `MaskAware` takes it from the
chain it wraps. Nothing is wired by callbacks: whoever holds the value reads
the current masks from it.
"""

import tensorflow as tf


class Masks:
    """The pruning masks of a model, keyed like the optimizer keys variables.

    Masks come from sources that keep masks of their own (pruning layers:
    read at every step through ``read``, so schedules are followed; the
    layers have masks once built) and/or explicit ``(variable, mask)``
    pairs. `attach` fills an empty one (a `MaskAware` made by
    ``from_config``); everyone holding it sees them.

    Args:
      key: the optimizer's variable key function (``optimizer._var_key``).
      read: ``read(sources) -> [(variable, mask)]``, the masks the sources
        hold now (the Keras host's ``pruning_masks``); only needed when
        sources are attached.
    """

    def __init__(self, key, read=None):
        self._key = key
        self._read = read
        self._sources = []
        self._pairs = []
        self._table = None

    def attach(self, sources=(), pairs=()):
        self._sources, self._pairs = list(sources), list(pairs)
        self._table = None

    @property
    def empty(self):
        """True until masks were given (a `MaskAware` made by ``from_config``)."""
        return not (self._sources or self._pairs)

    def explicit_unmatched(self, keys):
        """The explicit ``(variable, mask)`` pairs whose variable's key is not
        in ``keys`` (the variables an optimizer was built for)."""
        keys = set(keys)
        return [(v, m) for v, m in self._pairs if self._key(v) not in keys]

    @property
    def explicit_count(self):
        return len(self._pairs)

    def same_sources(self, sources):
        return [id(s) for s in sources] == [id(s) for s in self._sources]

    def table(self):
        """``{key: (variable, mask)}``; layers' masks appear once built."""
        if self._table is None:
            pairs = (self._read(self._sources) if self._sources else []) + self._pairs
            if not pairs:
                return {}  # layers not built yet: nothing to mask so far
            self._table = {self._key(variable): (variable, mask)
                           for variable, mask in pairs}
        return self._table

    def mask_for(self, variable, cast=True):
        """The current mask of ``variable`` in its dtype (``cast=False``: as
        it is kept), or None if unmasked. A mask variable of the same dtype,
        or any mask variable with ``cast=False``, is returned as is (LM reads
        its non-zero count when it traces a step)."""
        entry = self.table().get(self._key(variable))
        if entry is None:
            return None
        mask = entry[1]
        if isinstance(mask, tf.Variable) and (mask.dtype == variable.dtype or not cast):
            return mask
        return tf.cast(mask, variable.dtype)
