"""tfmot 0.8.1 as an oracle, in its own tf_keras process (its import sets
``TF_USE_LEGACY_KERAS=1``): run by `test_tfmot_conformance.py` as
``python tfmot_oracle.py SPEC.json INPUTS.npz OUT.npz``.

Every case the test file describes in SPEC (schedules at steps, constructor
arguments, masks of given weights, training scenarios) is answered here
with tfmot's own classes, and the answers written to OUT. Nothing here
decides what is right: the test compares.
"""

import json
import sys

import numpy as np


def _schedules(sk, spec, out):
    for i, case in enumerate(spec["schedules"]):
        schedule = getattr(sk, case["class"])(**case["config"])
        due, sparsity = [], []
        for step in case["steps"]:
            d, s = schedule(tf.constant(step, tf.int64))
            due.append(bool(d))
            sparsity.append(np.float32(s))
        out[f"schedule/{i}/due"] = np.array(due)
        out[f"schedule/{i}/sparsity"] = np.array(sparsity, np.float32)


def _validation(sk, spec, out):
    raised = []
    for case in spec["validation"]:
        try:
            getattr(sk, case["class"])(*case["args"])
            raised.append(False)
        except ValueError:
            raised.append(True)
    out["validation/raised"] = np.array(raised)


def _masks(pruning_impl, spec, inputs, out):
    for case in spec["masks"]:
        weights = tf.constant(inputs[case["id"]])
        m_by_n = tuple(case["m_by_n"]) if case.get("m_by_n") else None
        sparsity = case.get("sparsity", 0.0)
        impl = pruning_impl.Pruning(
            training_step_fn=lambda: 1, pruning_vars=[],
            pruning_schedule=lambda step, s=sparsity: (True, tf.constant(s, tf.float32)),
            block_size=tuple(case.get("block", (1, 1))),
            block_pooling_type=case.get("pooling", "AVG"), sparsity_m_by_n=m_by_n)
        try:
            _, mask = impl._maybe_update_block_mask(weights)  # pylint: disable=protected-access
        except ValueError:  # e.g. a pooled dimension of 1: tfmot squeezes it away
            out[f"refused/{case['id']}"] = np.array(True)
            continue
        out[f"mask/{case['id']}"] = np.asarray(mask, np.float32)


def _model(keras, kind, weights):
    layers = keras.layers
    if kind == "mlp":
        model = keras.Sequential([keras.Input((8,)),
                                  layers.Dense(16, activation="relu", name="d1"),
                                  layers.Dense(4, name="d2")])
    else:
        model = keras.Sequential([keras.Input((6, 6, 4)),
                                  layers.Conv2D(8, 3, activation="relu", name="c1"),
                                  layers.DepthwiseConv2D(3, name="dw"),
                                  layers.Flatten(),
                                  layers.Dense(4, name="d2")])
    model.set_weights(weights)
    return model


def _scenarios(keras, sk, spec, inputs, out):
    for case in spec["scenarios"]:
        name = case["name"]
        weights = [inputs[f"init/{case['model']}/{i}"]
                   for i in range(int(inputs[f"init/{case['model']}/count"]))]
        kwargs = {"block_size": tuple(case["block"]),
                  "block_pooling_type": case["pooling"].upper()}
        if case["schedule"] is not None:
            kwargs["pruning_schedule"] = getattr(sk, case["schedule"]["class"])(
                **case["schedule"]["config"])
        if case["m_by_n"]:
            kwargs["sparsity_m_by_n"] = tuple(case["m_by_n"])
        model = sk.prune_low_magnitude(_model(keras, case["model"], weights), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(case["lr"]), loss="mse")
        masks = {}

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                for layer in model.layers:
                    for weight, mask, _ in getattr(layer, "pruning_vars", []):
                        key = f"{layer.layer.name}/{weight.name.split('/')[-1].split(':')[0]}"
                        masks.setdefault(key, []).append(mask.numpy())

        x = inputs[f"x/{case['model']}"][:8 * case["batches"]]
        y = inputs[f"y/{case['model']}"][:8 * case["batches"]]
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[sk.UpdatePruningStep(), Record()])
        out[f"scenario/{name}/keys"] = np.array(sorted(masks))
        for key, values in masks.items():
            out[f"scenario/{name}/{key}"] = np.stack(values).astype(np.float32)


if __name__ == "__main__":
    import tensorflow_model_optimization as tfmot  # sets TF_USE_LEGACY_KERAS=1
    import tensorflow as tf
    import tf_keras
    from tensorflow_model_optimization.python.core.sparsity.keras import pruning_impl

    spec_path, inputs_path, out_path = sys.argv[1:4]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    inputs = dict(np.load(inputs_path))
    tf.keras.utils.set_random_seed(0)
    out = {"versions": np.array([tfmot.__version__, tf_keras.__version__])}
    _schedules(tfmot.sparsity.keras, spec, out)
    _validation(tfmot.sparsity.keras, spec, out)
    _masks(pruning_impl, spec, inputs, out)
    _scenarios(tf_keras, tfmot.sparsity.keras, spec, inputs, out)
    np.savez(out_path, **out)
