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
real optimizer updates: step ``j + 1`` is evaluated after update ``j`` (and
step 1 before the first), which is what tfmot's step ``j + 1`` sees without
gradient accumulation.
"""

import tensorflow as tf

__all__ = ["ConstantSparsity", "PolynomialDecay", "SCHEDULES", "serialize", "deserialize"]


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


class PruningSchedule:
    """``(should_prune, sparsity)`` for a step (see the module doc)."""

    def __init__(self, begin_step, end_step, frequency, allow_no_end):
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
        raise NotImplementedError

    def __call__(self, step):
        return self.should_prune(step), self.sparsity(step)

    def get_config(self):
        raise NotImplementedError

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


SCHEDULES = {cls.__name__: cls for cls in (ConstantSparsity, PolynomialDecay)}


def serialize(schedule):
    return {"class_name": type(schedule).__name__, "config": schedule.get_config()}


def deserialize(config):
    return SCHEDULES[config["class_name"]].from_config(config["config"])
