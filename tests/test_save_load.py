"""The save/load matrix: every optimizer, every format, saved mid-window or
mid-schedule, loaded and continued, equals the run that never stopped.

Formats: the native ``.keras`` file and ``tf.train.Checkpoint`` in both
flavours; the SavedModel directory and HDF5 ``.h5`` in tf_keras (Keras 3
writes SavedModels for inference only, ``model.export``, and keeps no
optimizer in ``.h5``). ``load_model`` alone is enough: the optimizers that
need their model (accumulation, LM, Lagrangian, MaskAware) are bound to the
model being loaded, and a tf_keras SavedModel's optimizer state (which
tf_keras itself never restores) is read back when the optimizer is built.
``tf_gradkit.attach(model)`` stays for optimizers made by ``from_config`` by
hand; until then they refuse to train, saying so.

Every case saves at a point where state matters: inside an accumulation
window, between dual updates of the Lagrangian, with LM's damping moved
from its start, with Frank-Wolfe's singular vector warm. The loaded run and
the uninterrupted one then run the same graph on the same data: equal to
the last bit.
"""

import json

import pytest
import tensorflow as tf

import tf_gradkit
from conftest import FLAVOUR, keras_module
from helpers import alternate_mask, max_abs_diff, mlp, regression_data, variables_of, weights_of
from tf_gradkit import constraints as C
from tf_gradkit.pruning import ConstantSparsity

K_ = keras_module()


@K_.saving.register_keras_serializable(package="tests")
def mean_output_at_most_half(y_pred, batch):
    """An output constraint defined at module level: saved by name."""
    del batch
    return tf.reduce_mean(y_pred) - 0.5


def _optimizers(K, gk):
    from tf_gradkit.core.lm import damping  # noqa: PLC0415
    return {
        "accumulator": lambda m: gk.GradientAccumulator(K.optimizers.Adam(0.05), 4,
                                                        model=m, epoch_end="carry"),
        "levenberg-marquardt": lambda m: gk.LevenbergMarquardt(
            m, controller=damping.Nielsen(initial=0.05), solver="qr"),
        "projected": lambda m: gk.Projected(K.optimizers.Adam(0.05),
                                            {"kernel": C.MaxNorm(1.0)}),
        "lagrangian": lambda m: gk.AugmentedLagrangian(
            K.optimizers.Adam(0.05), [gk.Inequality(mean_output_at_most_half)],
            model=m, dual_every=4),
        "frank-wolfe": lambda m: gk.ConditionalGradient(0.2, lambda_=3.0, ord="nuclear"),
        # The case: the accumulator's window and Projected's Adam.
        "accumulator-projected": lambda m: gk.GradientAccumulator(
            gk.Projected(K.optimizers.Adam(0.05), {"kernel": C.NonNeg()}), 4, model=m,
            epoch_end="carry"),
        "magnitude-pruning": lambda m: gk.MagnitudePruning(
            K.optimizers.Adam(0.05), model=m, schedule=ConstantSparsity(0.5, 0)),
        # Explicit masks: data, not configuration (attached again after a load).
        "mask-aware": lambda m: gk.MaskAware(K.optimizers.Adam(0.05), masks=alternate_mask(m)),
        # Keras 3.15: an accumulator for the first layer, Adam for the rest.
        "multioptimizer": lambda m: K.optimizers.MultiOptimizer(K.optimizers.OptimizerMap(
            default_optimizer=K.optimizers.Adam(0.05),
            # Keys are matched whole (re.fullmatch): the layer's path and ".*".
            optimizer_map={m.trainable_variables[0].path.rsplit("/", 1)[0] + "/.*":
                           gk.GradientAccumulator(K.optimizers.Adam(0.05), 4, model=m,
                                                  epoch_end="carry")})),
    }


FORMATS = ["keras", "checkpoint"] + (["savedmodel", "h5"] if FLAVOUR == "tf_keras" else [])
NAMES = ["accumulator", "levenberg-marquardt", "projected", "lagrangian", "frank-wolfe",
         "accumulator-projected", "magnitude-pruning", "mask-aware"] + (
             ["multioptimizer"]  # Keras 3.15+
             if hasattr(K_.optimizers, "MultiOptimizer") else [])


def _fit(model, x, y):
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)


def _groups(model):
    """A MultiOptimizer's optimizers, which its checkpoint does not hold
    (Keras 3.15; test below): checkpointed beside it (docs/composing.md)."""
    group = getattr(model.optimizer, "optimizers", None)
    return {f"optimizer_{i}": o for i, o in enumerate(group)} if isinstance(group, list) else {}


# The run that never stopped, per optimizer: its final weights and optimizer
# variables. It involves no saving and no format, and is seeded and
# deterministic (the mlp's weights are fixed by a seed, the data unshuffled),
# so it is trained once per process, by the first format's case, and the
# other formats compare with the same numbers.
_UNINTERRUPTED = {}


def _uninterrupted(K, make, name, first, second):
    if name not in _UNINTERRUPTED:
        full = mlp(K)
        full.compile(optimizer=make(full), loss="mse")
        _fit(full, *first)
        _fit(full, *second)
        _UNINTERRUPTED[name] = (weights_of(full), variables_of(full.optimizer))
    return _UNINTERRUPTED[name]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_save_mid_run_load_and_continue_exactly(K, gk, tmp_path, name, fmt):
    x, y = regression_data(n=24)
    first, second = (x[:12], y[:12]), (x[12:], y[12:])
    make = _optimizers(K, gk)[name]

    stopped = mlp(K)
    stopped.compile(optimizer=make(stopped), loss="mse")
    _fit(stopped, *first)
    if name.startswith("accumulator"):  # 3 micro-batches: the window is open
        assert int(stopped.optimizer.window_micro_step.numpy()) == 3
    if name == "multioptimizer":  # the accumulator's group is really its own
        windows = [int(o.window_micro_step.numpy()) for o in stopped.optimizer.optimizers
                   if hasattr(o, "window_micro_step")]
        assert windows == [3]

    if fmt == "checkpoint":
        path = tf.train.Checkpoint(model=stopped, optimizer=stopped.optimizer,
                                   **_groups(stopped)).save(str(tmp_path / "ckpt"))
        loaded = mlp(K, seed=7)  # other initial weights: all restored
        loaded.compile(optimizer=make(loaded), loss="mse")
        loaded.optimizer.build(loaded.trainable_variables)
        tf.train.Checkpoint(model=loaded, optimizer=loaded.optimizer,
                            **_groups(loaded)).restore(path).assert_existing_objects_matched()
    else:
        path = str(tmp_path / {"keras": "m.keras", "h5": "m.h5",
                               "savedmodel": "saved"}[fmt])
        stopped.save(path)
        # Nothing but load_model: bound again, and (SavedModel) the state
        # tf_keras leaves behind read back when the optimizer is built.
        loaded = K.models.load_model(path)
        if name == "multioptimizer":
            # Keras 3.15 loads the layers under other paths (no model-name
            # prefix), so the map's path key matches nothing: Keras skips its
            # optimizers' state with a warning and would hand the
            # accumulator's variables to the default optimizer. Refused at
            # the first fit, naming the key (docs/composing.md).
            with pytest.raises(ValueError, match="matched no variable"):
                _fit(loaded, *second)
            return
        loaded.optimizer.build(loaded.trainable_variables)
        if name == "mask-aware":  # explicit masks are not saved: given again
            loaded.optimizer.attach(masks=alternate_mask(loaded))
        assert type(loaded.optimizer) is type(stopped.optimizer)
        if name != "multioptimizer":  # Keras's get_config holds its map object
            assert loaded.optimizer.get_config() == stopped.optimizer.get_config()
    assert max_abs_diff(variables_of(stopped.optimizer),
                        variables_of(loaded.optimizer)) == 0

    _fit(loaded, *second)
    full_weights, full_variables = _uninterrupted(K, make, name, first, second)
    assert max_abs_diff(full_weights, weights_of(loaded)) == 0
    assert max_abs_diff(full_variables, variables_of(loaded.optimizer)) == 0


@pytest.mark.parametrize("name", ["accumulator", "levenberg-marquardt"])
def test_an_optimizer_made_from_config_by_hand_refuses_to_train_until_attached(
        K, gk, tmp_path, name):
    # Only Keras's loader tells which model a loaded optimizer belongs to;
    # from_config called by hand (a model rebuilt from its config and
    # compiled with it) needs attach, and says so.
    x, y = regression_data(n=16)
    model = mlp(K)
    model.compile(optimizer=_optimizers(K, gk)[name](model), loss="mse")
    _fit(model, x, y)
    config = model.optimizer.get_config()
    other = mlp(K)
    other.compile(optimizer=type(model.optimizer).from_config(config), loss="mse")
    before = weights_of(other)
    with pytest.raises(ValueError, match=r"tf_gradkit\.attach\(model\)"):
        _fit(other, x, y)
    assert max_abs_diff(before, weights_of(other)) == 0
    tf_gradkit.attach(other)
    _fit(other, x, y)
    assert max_abs_diff(before, weights_of(other)) > 0


@pytest.mark.parametrize("fmt", FORMATS[:1] + FORMATS[2:])
def test_a_loaded_model_trains_without_attach_and_attach_changes_nothing(
        K, gk, tmp_path, fmt):
    # ModelCheckpoint/BackupAndRestore flows: load_model, then fit.
    x, y = regression_data(n=24)
    make = _optimizers(K, gk)["accumulator"]
    model = mlp(K)
    model.compile(optimizer=make(model), loss="mse")
    _fit(model, x[:12], y[:12])
    path = str(tmp_path / {"keras": "m.keras", "h5": "m.h5", "savedmodel": "saved"}[fmt])
    model.save(path)
    loaded, again = K.models.load_model(path), K.models.load_model(path)
    tf_gradkit.attach(again)  # what users were told to do: still harmless
    for m in (model, loaded, again):
        _fit(m, x[12:], y[12:])
    assert max_abs_diff(weights_of(model), weights_of(loaded)) == 0
    assert max_abs_diff(weights_of(model), weights_of(again)) == 0
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())


def test_tf_keras_savedmodel_drops_every_optimizer_state_without_the_helper(K, tmp_path):
    # Why tf_gradkit restores its optimizers' state from a SavedModel itself,
    # and why `load_optimizer_state` exists for Keras's own optimizers:
    # tf_keras loses Adam's state too.
    if FLAVOUR != "tf_keras":
        pytest.skip("Keras 3 SavedModels are for inference (model.export)")
    x, y = regression_data(n=16)
    model = mlp(K)
    model.compile(optimizer=K.optimizers.Adam(0.05), loss="mse")
    _fit(model, x, y)
    model.save(str(tmp_path / "saved"))
    plain = K.models.load_model(str(tmp_path / "saved"))
    plain.optimizer.build(plain.trainable_variables)
    assert int(plain.optimizer.iterations.numpy()) == 0
    restored = tf_gradkit.load_optimizer_state(K.models.load_model(str(tmp_path / "saved")),
                                               str(tmp_path / "saved"))
    assert max_abs_diff(variables_of(model.optimizer), variables_of(restored.optimizer)) == 0


def test_keras_multioptimizer_checkpoints_lose_its_optimizers_without_them(K, tmp_path):
    # Why the matrix checkpoints a MultiOptimizer's optimizers beside it:
    # Keras 3.15's MultiOptimizer does not make them checkpoint dependencies,
    # so tf.train.Checkpoint restores none of their state (Adam's alike).
    if not hasattr(K.optimizers, "MultiOptimizer"):
        pytest.skip("MultiOptimizer is Keras 3.15+'s")
    x, y = regression_data(n=16)

    def make():
        model = mlp(K)
        model.compile(optimizer=K.optimizers.MultiOptimizer(K.optimizers.OptimizerMap(
            default_optimizer=K.optimizers.Adam(0.05))), loss="mse")
        return model

    model = make()
    _fit(model, x, y)
    path = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    loaded = make()
    loaded.optimizer.build(loaded.trainable_variables)
    tf.train.Checkpoint(optimizer=loaded.optimizer).restore(path)
    assert int(loaded.optimizer.optimizers[0].iterations.numpy()) == 0 != \
        int(model.optimizer.optimizers[0].iterations.numpy())


def test_lagrangian_with_a_lambda_cannot_be_saved_silently(K, gk, tmp_path):
    x, y = regression_data(n=16)
    model = mlp(K)
    kernel = model.trainable_variables[0]
    model.compile(optimizer=gk.AugmentedLagrangian(
        K.optimizers.Adam(0.05),
        [gk.Inequality(lambda: tf.reduce_sum(tf.square(kernel)) - 1.0, name="norm")]),
        loss="mse")
    _fit(model, x, y)
    model.save(str(tmp_path / "m.keras"))
    with pytest.raises(ValueError, match=r"\['norm'\] are lambdas or closures.*"
                       r"module's top level"):
        K.models.load_model(str(tmp_path / "m.keras"))


def test_every_constructor_argument_survives_get_config(K, gk):
    from tf_gradkit.core.lm import damping  # noqa: PLC0415
    from tf_gradkit.core.lm import linear_solvers as solvers  # noqa: PLC0415
    lm = gk.LevenbergMarquardt(
        controller=damping.MultiplyDivide(initial=0.3, increase=7.0, decrease=0.2,
                                          floor=1e-9, ceiling=1e9),
        scaling="levenberg", solver=solvers.ConjugateGradient(max_iterations=17,
                                                              tolerance=1e-4),
        max_attempts=6, chunk_size=None, name="lm")
    clone = type(lm).from_config(lm.get_config())
    assert clone.get_config() == lm.get_config()
    assert vars(clone.controller) == vars(lm.controller)
    assert (clone.solver.max_iterations, clone.solver.tolerance) == (17, 1e-4)
    assert clone.max_attempts == 6 and clone.name == "lm"
    lm = gk.LevenbergMarquardt(
        controller=damping.TrustRegion(factor=7.0, max_solves=4),
        scaling=damping.Marquardt(monotone=False))
    clone = type(lm).from_config(lm.get_config())
    assert vars(clone.controller) == {"factor": 7.0, "max_solves": 4}
    assert clone.scaling.monotone is False

    acc = gk.GradientAccumulator(K.optimizers.SGD(0.3, momentum=0.5), 5,
                                 reduction="sum", epoch_end="drop", nonfinite="raise",
                                 accumulator_dtype="float64", name="acc")
    clone = type(acc).from_config(acc.get_config())
    assert clone.get_config() == acc.get_config()
    assert clone.inner_optimizer.get_config() == acc.inner_optimizer.get_config()
    assert clone.accumulator_dtype == "float64"
    # A config saved before `accumulator_dtype` existed loads with the default
    # (None: float32 sums for 16-bit variables).
    old = {k: v for k, v in acc.get_config().items() if k != "accumulator_dtype"}
    assert type(acc).from_config(old).accumulator_dtype is None

    fw = gk.ConditionalGradient(0.3, lambda_={"kernel": 2.0, ".*": 1.0}, ord="k_sparse",
                                k=3, power_iterations=4, epsilon=1e-6)
    assert type(fw).from_config(fw.get_config()).get_config() == fw.get_config()

    proj = gk.Projected(K.optimizers.Adam(0.1), {"kernel": C.Box(-1.0, 2.0),
                                                 "bias": C.L1Ball(3.0)},
                        sparse_rows=False)
    clone = type(proj).from_config(proj.get_config())
    assert clone.get_config() == proj.get_config()


def test_lm_configs_name_parts_by_their_table_names(gk):
    config = {"name": "lm", "controller": "nielsen", "scaling": "marquardt",
              "solver": "dual", "max_attempts": 4, "chunk_size": None}
    lm = gk.LevenbergMarquardt.from_config(config)
    assert type(lm.solver).__name__ == "NormalEquationsDual" and lm.max_attempts == 4
    # A lower-cased class name (an unreleased pre-0.2 layout) is refused by name.
    with pytest.raises(ValueError, match=r"`solver` must be one of \['auto', 'cg', 'cholesky', "
                                         r"'dual', 'qr'\] or an object\. Received: "
                                         r"solver='normalequationsdual'"):
        gk.LevenbergMarquardt.from_config(dict(config, solver="normalequationsdual"))


def test_h5_names_are_unique(K, gk):
    if FLAVOUR != "tf_keras":
        pytest.skip("HDF5 keeps optimizer weights by name in tf_keras only")
    model = mlp(K)
    opt = gk.GradientAccumulator(gk.Projected(K.optimizers.Adam(0.1),
                                              {"kernel": C.NonNeg()}), 2, model=model)
    model.compile(optimizer=opt, loss="mse")
    _fit(model, *regression_data(n=8))
    names = [v.name for v in opt.variables]
    assert len(names) == len(set(names)), names


@pytest.mark.parametrize("written_by", ["this tf_keras", "tf_keras <= 2.18"])
def test_h5_registered_constraint_loads_in_either_saved_form(K, gk, tmp_path, written_by):
    # tf_keras <= 2.18 writes a registered function's bare name in "config"
    # (its registered name beside it), 2.19+ "package>name"; tf_gradkit
    # writes "package>name" on every version and loads both forms.
    if FLAVOUR != "tf_keras":
        pytest.skip("Keras 3 keeps no optimizer in .h5")
    import h5py  # noqa: PLC0415  (TensorFlow's own dependency)
    x, y = regression_data(n=8)
    model = mlp(K)
    model.compile(optimizer=_optimizers(K, gk)["lagrangian"](model), loss="mse")
    _fit(model, x, y)
    path = str(tmp_path / "m.h5")
    model.save(path)
    with h5py.File(path, "r+") as f:
        training = json.loads(f.attrs["training_config"])
        saved = training["optimizer_config"]["config"]["constraints"][0]["fn"]
        assert saved["config"] == "tests>mean_output_at_most_half", saved
        if written_by == "tf_keras <= 2.18":
            saved.update(config="mean_output_at_most_half", module="a_module_not_imported")
            f.attrs["training_config"] = json.dumps(training)
    loaded = K.models.load_model(path)
    assert loaded.optimizer._specs[0].fn is mean_output_at_most_half
    loaded.optimizer.build(loaded.trainable_variables)
    assert max_abs_diff(variables_of(model.optimizer), variables_of(loaded.optimizer)) == 0
    _fit(model, x, y)
    _fit(loaded, x, y)
    assert max_abs_diff(weights_of(model), weights_of(loaded)) == 0
