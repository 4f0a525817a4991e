"""TensorFlow's own multi-worker engines, made usable from Keras 3.

`MultiWorkerMirroredStrategy` is ``tf.distribute.MultiWorkerMirroredStrategy``
with one method changed, so that Keras 3's ``fit``, ``evaluate`` and
``predict`` run under it (tf_keras needs no change; custom training loops
with Keras 3 need none either). Pure TensorFlow: no Keras is imported.

Why. Under ``tf.distribute.MultiWorkerMirroredStrategy`` with two or more
workers, Keras 3.15's TensorFlow trainer fails inside Keras, with plain SGD
too (TensorFlow issue #72388, keras-team/keras #20585), at two calls of
``strategy.reduce`` in ``keras/src/backend/tensorflow/trainer.py``:

1. ``_maybe_symbolic_build`` (line 731), run by ``fit`` and ``evaluate``
   before the train function is made, reduces the whole ``(x, y)`` batch
   tuple: ``strategy.reduce("MEAN", batch, axis=None)``. MirroredStrategy
   maps a reduce over a nest; MultiWorkerMirroredStrategy's ``_reduce_to``
   does not and hands the tuple of ``PerReplica`` values to
   ``ops.convert_to_tensor`` ("Attempt to convert a value (PerReplica...)").
2. ``reduce_per_replica`` (line 841) reduces every scalar log with
   ``strategy.reduce("MEAN", value, axis=0)`` when there are several
   workers ("Invalid reduction dimension 0 for input with 0 dimensions").

This strategy's ``reduce`` maps over nests and reduces a rank-0 value over
replicas only (``axis=None``), which is what both calls mean. Every call
that worked before gives the same result. Found by reproducing both errors
with two worker processes on loopback (`tests/test_multiworker.py`).

Example (on each worker, with ``TF_CONFIG`` set as for TensorFlow's own)::

    strategy = tf_gradkit.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=GradientAccumulator(Adam(), steps=4, model=model),
                      loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3)
"""

import tensorflow as tf

__all__ = ["MultiWorkerMirroredStrategy"]


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """``tf.distribute.MultiWorkerMirroredStrategy`` that Keras 3 can use.

    Same constructor (``cluster_resolver=None, communication_options=None``)
    and behaviour; ``reduce`` also takes a nest of values and treats
    ``axis=0`` on a rank-0 value as ``axis=None`` (see the module doc).
    """

    def reduce(self, reduce_op, value, axis=None):
        def one(v):
            local = v.values[0] if isinstance(v, tf.distribute.DistributedValues) else v
            shape = getattr(local, "shape", None)
            scalar = axis is not None and shape is not None and shape.rank == 0
            return super(MultiWorkerMirroredStrategy, self).reduce(
                reduce_op, v, axis=None if scalar else axis)

        return tf.nest.map_structure(one, value)
