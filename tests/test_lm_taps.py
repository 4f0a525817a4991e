"""LevenbergMarquardt's tapped linearisation: the Jacobian from layer taps
(`tf_gradkit.gradients.tapped_jacobian`) equals the forward-mode Jacobian for
every covered layer kind, one fit step through it equals one through
automatic differentiation (supports, chunks, sample weights, solvers, the
GGN, MirroredStrategy), and models it cannot cover fall back visibly."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm.linear_solvers import ConjugateGradient
from tf_gradkit.gradients import tapped_jacobian

from conftest import compile_fn, mode_with_function_slow
from helpers import float32_matmuls, weights_of


@pytest.fixture(autouse=True)
def _float32_products():
    # The taps and forward mode are compared to float32 round-off: with
    # TF32 (a GPU's default) both sides' products round differently.
    with float32_matmuls():
        yield


# "function" (tf.function without XLA) under `make test-slow` only: the one
# default test taking `mode` keeps "jit", the graph-mode run of the same check.
mode = mode_with_function_slow()


def _tf_vars(variables):
    """The tf.Variables behind a model's variables (Keras 3 wraps them)."""
    return [v if isinstance(v, tf.Variable) else v.value for v in variables]


def _randomise(model, seed=3, scale=0.5):
    rng = np.random.RandomState(seed)
    model.set_weights([(rng.randn(*w.shape) * scale).astype(w.dtype)
                       for w in model.get_weights()])


def _kind_model(K, kind):
    """(model, x, training) of one covered layer kind (residuals: outputs - 0.3)."""
    rng = np.random.RandomState(0)
    L = K.layers
    if kind == "dense":
        model = K.Sequential([K.Input((3,)), L.Dense(4, activation="tanh"), L.Dense(2)])
        x = rng.randn(6, 3)
    elif kind == "dense_rank3":
        model = K.Sequential([K.Input((3, 2)), L.Dense(4, activation="tanh"),
                              L.Flatten(), L.Dense(1)])
        x = rng.randn(5, 3, 2)
    elif kind == "conv1d":
        model = K.Sequential([K.Input((6, 2)), L.Conv1D(3, 3, padding="causal",
                                                        activation="tanh"),
                              L.Flatten(), L.Dense(1)])
        x = rng.randn(5, 6, 2)
    elif kind == "conv2d":
        model = K.Sequential([K.Input((5, 5, 2)), L.Conv2D(3, 3, strides=2, padding="same",
                                                           activation="tanh"),
                              L.GlobalAveragePooling2D(), L.Dense(2)])
        x = rng.randn(4, 5, 5, 2)
    elif kind == "embedding":
        model = K.Sequential([K.Input((4,), dtype="int32"), L.Embedding(7, 3),
                              L.Flatten(), L.Dense(1)])
        x = rng.randint(0, 7, (5, 4)).astype("int32")
    elif kind == "layer_norm":
        model = K.Sequential([K.Input((3, 4)), L.Dense(5), L.LayerNormalization(),
                              L.Flatten(), L.Dense(1)])
        x = rng.randn(5, 3, 4)
    elif kind == "shared":  # one Dense called twice: its rows add
        inputs = K.Input((3,))
        shared = L.Dense(3, activation="tanh")
        model = K.Model(inputs, L.Dense(1)(shared(shared(inputs))))
        x = rng.randn(6, 3)
    elif kind == "frozen_batch_norm":  # not trainable: inference, per example
        model = K.Sequential([K.Input((3,)), L.Dense(4), L.BatchNormalization(),
                              L.Dense(1)])
        model.layers[1].trainable = False
        x = rng.randn(6, 3)
    else:  # "batch_norm_inference": trainable, called with training=False
        model = K.Sequential([K.Input((3,)), L.Dense(4), L.BatchNormalization(),
                              L.Dense(1)])
        x = rng.randn(6, 3)
    _randomise(model)
    if kind.endswith("batch_norm") or kind == "batch_norm_inference":
        bn = model.layers[1]
        bn.moving_variance.assign(np.linspace(0.5, 2.0, 4))
    x = x.astype("int32" if kind == "embedding" else "float32")
    return model, tf.constant(x), kind != "batch_norm_inference"


KINDS = ["dense", "dense_rank3", "conv1d", "conv2d", "embedding", "layer_norm",
         "shared", "frozen_batch_norm", "batch_norm_inference"]


@pytest.mark.parametrize("kind", KINDS)
def test_tapped_jacobian_equals_forward_mode(K, kind):
    model, x, training = _kind_model(K, kind)
    variables = model.trainable_variables
    steps, why = tapped_jacobian.plan(model, variables, training=training)
    assert why is None, why

    def rows():
        out = model(x, training=training)
        return tf.reshape(out, [tf.shape(out)[0], -1]) - 0.3

    r, jac = tapped_jacobian.residuals_and_jacobian(steps, variables, rows, tf.float32)
    # (tf_keras's Embedding cannot be traced by an eager vectorised JVP
    # twice, "Duplicate node name": reverse mode is the reference there.)
    r_ref, jac_ref = lin_lib.residuals_and_jacobian(
        lambda: tf.reshape(rows(), [-1]), _tf_vars(variables), tf.float32,
        mode="reverse" if kind == "embedding" else "forward")
    # Each entry is a sum of at most ~25 float32 products either way.
    scale = float(np.max(np.abs(jac_ref)))
    assert scale > 0
    np.testing.assert_allclose(r, r_ref, atol=1e-6)
    np.testing.assert_allclose(jac, jac_ref, atol=3e-6 * scale)
    jtj, jtr = lin_lib.normal_equations(jac, r)
    jtj_ref, jtr_ref = lin_lib.normal_equations(jac_ref, r_ref)
    np.testing.assert_allclose(jtj, jtj_ref, atol=1e-5 * float(np.max(np.abs(jtj_ref))))
    np.testing.assert_allclose(jtr, jtr_ref, atol=1e-5 * float(np.max(np.abs(jtr_ref))))


def test_tapped_jacobian_compiled(K):
    model, x, _ = _kind_model(K, "dense")
    variables = model.trainable_variables
    steps, _ = tapped_jacobian.plan(model, variables)
    rows = lambda: model(x, training=True) - 0.3  # noqa: E731
    eager = tapped_jacobian.residuals_and_jacobian(steps, variables, rows, tf.float32)
    jit = tf.function(lambda: tapped_jacobian.residuals_and_jacobian(
        steps, variables, rows, tf.float32), jit_compile=True)()
    np.testing.assert_allclose(jit[1], eager[1], atol=1e-6)


def _problem(K, loss="mse", outputs=1, seed=0):
    """A float64 MLP and its batch: one LM step's round-off stays ~1e-13."""
    rng = np.random.RandomState(seed)
    x = rng.randn(24, 3)
    if "crossentropy" not in loss:
        y = np.concatenate([np.sin(x @ rng.randn(3, 1)) for _ in range(outputs)], 1)
    elif loss == "binary_crossentropy":
        y = (x[:, :1] > 0).astype("float64")
    else:
        y = ((x[:, :1] > 0).astype("int64") + (x[:, 1:2] > 0)).astype("int64")
    width = 3 if loss == "sparse_categorical_crossentropy" else outputs
    # Probabilities where the loss takes them (from_logits=False): raw Dense
    # outputs would be clipped to [eps, 1 - eps], where nothing has a
    # gradient (the step was zero on an H200, and eagerly on CPUs).
    last = {"binary_crossentropy": "sigmoid",
            "sparse_categorical_crossentropy": "softmax"}.get(loss)

    def build(**kwargs):
        model = K.Sequential([K.Input((3,), dtype="float64"),
                              K.layers.Dense(5, activation="tanh", dtype="float64"),
                              K.layers.Dense(width, activation=last, dtype="float64")])
        _randomise(model, seed=1)
        from tf_gradkit import optimizers  # noqa: PLC0415
        opt = optimizers.LevenbergMarquardt(model, **kwargs)
        model.compile(optimizer=opt, loss=loss, run_eagerly=kwargs.pop("eager", False))
        return model, opt

    return x, y, build


def _one_step(K, mode, loss="mse", outputs=1, sample_weight=None, masks=False,
              atol=None, **kwargs):
    """One fit step with the taps and one by autodiff: equal to within
    ``atol(model, x, y)`` at the starting weights (default: float64
    round-off, ``1e-8`` times the step's size). The autodiff reference runs
    eagerly (one XLA compilation fewer, the same float64 math), except with
    a ``subset``: a random subset is drawn by each mode's own generator."""
    x, y, build = _problem(K, loss, outputs)
    results = []
    reference = mode if "subset" in kwargs else "eager"
    for linearization, run in (("auto", mode), ("autodiff", reference)):
        model, opt = build(linearization=linearization, **kwargs)
        model.compile(optimizer=opt, loss=loss, run_eagerly=run == "eager",
                      jit_compile=run == "jit")
        if masks:
            from test_lm_support import give_masks  # noqa: PLC0415
            mask = (np.random.RandomState(2).rand(3, 5) < 0.5).astype("float64")
            model.set_weights([model.get_weights()[0] * mask] + model.get_weights()[1:])
            give_masks(opt, model, tf.Variable(mask))
        before = weights_of(model)
        bound = None if atol is None else atol(model, x, y)
        model.fit(x, y, sample_weight=sample_weight, batch_size=len(x), epochs=1,
                  shuffle=False, verbose=0)
        step = [a - b for a, b in zip(weights_of(model), before)]
        results.append((opt.linearization_used, step, int(opt.last_attempts.numpy())))
    (used, step, attempts), (used_ref, step_ref, attempts_ref) = results
    assert used == "taps", used
    assert used_ref.startswith("autodiff")
    assert attempts == attempts_ref
    size = max(float(np.max(np.abs(s))) for s in step_ref)
    assert size > 0
    for s, s_ref in zip(step, step_ref):
        np.testing.assert_allclose(s, s_ref, atol=1e-8 * size if bound is None
                                   else bound)


def test_fit_step_equals_autodiff(K, mode):
    _one_step(K, mode)


@pytest.mark.parametrize("case", [
    {"outputs": 2, "sample_weight": np.linspace(0.2, 2.0, 24), "chunk_size": 7,
     "subset": 0.5},
    {"loss": "sparse_categorical_crossentropy"},
    {"masks": True, "solver": "qr"},
], ids=["weights-2-outputs-chunks-subset", "ggn", "masks-qr"])
def test_fit_step_options_equal_autodiff(K, case):
    _one_step(K, "jit", **case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    {"outputs": 2, "sample_weight": np.linspace(0.2, 2.0, 24)},
    {"chunk_size": 5, "sample_weight": np.linspace(0.2, 2.0, 24)},
    {"subset": 0.5},
    {"subset": "layers"},
    {"solver": "qr"},
    {"solver": "dual"},
    {"loss": "huber"},
    {"loss": "mae"},
    {"loss": "binary_crossentropy"},
    {"masks": True},
])
def test_fit_step_more_options_equal_autodiff(K, mode, case):
    _one_step(K, mode, **case)


@pytest.mark.parametrize("kind", ["dense", "layer_norm"])
def test_matrix_free_products_equal_the_jacobian(K, kind):
    # J^T (J v) and J^T r from taps (Dense: factored, never the rows; other
    # kinds: their rows) against the forward-mode Jacobian's.
    model, x, training = _kind_model(K, kind)
    variables = model.trainable_variables
    steps, _ = tapped_jacobian.plan(model, variables, training=training)

    def rows():
        out = model(x, training=training)
        return tf.reshape(out, [tf.shape(out)[0], -1]) - 0.3

    r, jtr, matvec = tapped_jacobian.matrix_free(steps, variables, rows, tf.float32)
    r_ref, jac = lin_lib.residuals_and_jacobian(
        lambda: tf.reshape(rows(), [-1]), _tf_vars(variables), tf.float32,
        mode="forward")
    v = tf.constant(np.random.RandomState(5).randn(jac.shape[1]).astype("float32"))
    want = tf.linalg.matvec(jac, tf.linalg.matvec(jac, v), transpose_a=True)
    np.testing.assert_allclose(r, r_ref, atol=1e-6)
    np.testing.assert_allclose(jtr, tf.linalg.matvec(jac, r_ref, transpose_a=True),
                               atol=1e-5 * float(np.max(np.abs(jtr))))
    np.testing.assert_allclose(matvec(v), want, atol=1e-5 * float(np.max(np.abs(want))))


CG_TOLERANCE = 1e-10


def _cg_bound(model, x, y):
    """How far two CG steps on the same system may differ: CG stops once
    ``|A d + b| <= tolerance * |b|`` (`linear_solvers.ConjugateGradient`),
    so each step is within ``|A^-1| tolerance |b| <= tolerance |b| / lambda``
    of the exact one (``A = J^T J + lambda I``, lambda = 1 here), whatever
    the iteration each stops at: operators equal to round-off (other
    reduction orders, as on a GPU) can stop an iteration apart. Plus
    float64 round-off (|d| <= |b| / lambda). Here the bound is ~7e-9 of the
    step's size; a product 1e-4 off (relative: J^T J scaled, perturbed or
    formed from perturbed rows, or J^T r scaled) moves the step by 8e-5 to
    3e-3 of its size."""
    with tf.GradientTape() as tape:  # b = J^T r = the gradient of 0.5 |r|^2
        cost = 0.5 * tf.reduce_sum(tf.square(model(x) - y))
    b = np.concatenate([np.ravel(g) for g in tape.gradient(
        cost, model.trainable_variables)])
    return (2 * CG_TOLERANCE + 1e-12) * float(np.linalg.norm(b)) / 1.0


def test_fit_step_cg_equals_autodiff(K):
    # One attempt, at lambda = 1 (the bound's lambda). A tight CG tolerance
    # (it converges in ~20 of its 100 iterations here), so that the
    # stopping rule's bound is small enough to catch wrong products.
    _one_step(K, "jit", solver=ConjugateGradient(100, CG_TOLERANCE),
              scaling="levenberg", max_attempts=1, initial_damping=1.0,
              atol=_cg_bound)


@pytest.mark.distributed
def test_mirrored_fit_uses_taps(K, gk, mirrored):
    # test_levenberg_marquardt's mirrored test compares the (default, tapped)
    # step with one device's; here: the taps were used on both replicas and
    # the step equals the autodiff one under the same strategy.
    x, y, build = _problem(K)
    steps = []
    for linearization in ("auto", "autodiff"):
        with mirrored.scope():
            model, opt = build(linearization=linearization)
        before = weights_of(model)
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        steps.append((opt.linearization_used, [a - b for a, b in zip(weights_of(model),
                                                                       before)]))
    assert steps[0][0] == "taps" and steps[1][0].startswith("autodiff")
    size = max(float(np.max(np.abs(s))) for s in steps[1][1])
    for s, s_ref in zip(steps[0][1], steps[1][1]):
        np.testing.assert_allclose(s, s_ref, atol=1e-8 * size)


def _fit_once(K, model, linearization="auto", **kwargs):
    from tf_gradkit import optimizers  # noqa: PLC0415
    opt = optimizers.LevenbergMarquardt(model, linearization=linearization, **kwargs)
    # Not XLA: on a GPU (where Keras 3's fit picks XLA by default) forward
    # mode through the SimpleRNN's loop needs TensorListReserve, which XLA's
    # GPU compiler lacks; the fallback itself is what is checked here.
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x = np.random.RandomState(0).randn(8, 3).astype("float32")
    model.fit(x, np.zeros((8, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    return opt


def test_uncovered_models_fall_back_visibly(K):
    L = K.layers

    class Subclassed(K.Model):
        def __init__(self):
            super().__init__()
            self.dense = L.Dense(1)

        def call(self, x):  # mixes the examples
            h = self.dense(x)
            return h - tf.reduce_mean(h, 0)

    batch_norm = K.Sequential([K.Input((3,)), L.Dense(2), L.BatchNormalization(),
                               L.Dense(1)])
    gru = K.Sequential([K.Input((3,)), L.Reshape((3, 1)), L.SimpleRNN(2), L.Dense(1)])
    for model, said in ((Subclassed(), "not a Sequential or functional"),
                        (batch_norm, "training=True"), (gru, "no rule")):
        opt = _fit_once(K, model)
        assert opt.linearization_used.startswith("autodiff"), opt.linearization_used
        assert said in opt.linearization_used
        with pytest.raises(ValueError, match="linearization='taps'"):
            _fit_once(K, model, linearization="taps")
    custom = _fit_once(K, K.Sequential([K.Input((3,)), L.Dense(1)]),
                       residuals=lambda m, x, y, w: m(x) - y)
    assert "residuals=" in custom.linearization_used


def test_layers_not_provably_their_class_fall_back_visibly(K):
    """A Dense subclass overriding `call` (the taps would record what its
    `call` receives, not what the matmul sees), a weightless layer subclass
    whose `call` mixes the examples linearise by automatic differentiation,
    saying why; a subclass that only adds an `__init__` keeps the taps."""
    L = K.layers

    class ScaledDense(L.Dense):
        def call(self, x):
            return super().call(2.0 * x)

    class Centred(L.Activation):
        def call(self, x):  # mixes the examples
            return x - tf.reduce_mean(x, 0)

    class Named(L.Dense):
        def __init__(self, units, **kwargs):
            super().__init__(units, **kwargs)

    scaled = K.Sequential([K.Input((3,)), ScaledDense(2, name="scaled"), L.Dense(1)])
    centred = K.Sequential([K.Input((3,)), L.Dense(2), Centred("linear"), L.Dense(1)])
    for model, said in ((scaled, "overrides ['call']"), (centred, "no rule")):
        opt = _fit_once(K, model)
        assert opt.linearization_used.startswith("autodiff"), opt.linearization_used
        assert said in opt.linearization_used, opt.linearization_used
    opt = _fit_once(K, K.Sequential([K.Input((3,)), Named(1)]))
    assert not opt.linearization_used.startswith("autodiff"), opt.linearization_used


def test_linearization_argument(gk):
    with pytest.raises(ValueError, match="linearization.*Received: linearization='x'"):
        gk.LevenbergMarquardt(linearization="x")
    opt = gk.LevenbergMarquardt(linearization="autodiff")
    assert opt.get_config()["linearization"] == "autodiff"
    assert gk.LevenbergMarquardt.from_config(opt.get_config()).linearization == "autodiff"


# ------------------------------------------------- minimize(..., model=)
def _minimize_once(K, gk, mode, residuals, linearization, solver="cholesky"):
    """One minimize step on a float64 MLP: (step, linearization_used)."""
    rng = np.random.RandomState(0)
    x, y = tf.constant(rng.randn(12, 3)), tf.constant(rng.randn(12, 2))
    model = K.Sequential([K.Input((3,), dtype="float64"),
                          K.layers.Dense(4, activation="tanh", dtype="float64"),
                          K.layers.Dense(2, dtype="float64")])
    _randomise(model, seed=1)
    opt = gk.LevenbergMarquardt(linearization=linearization, solver=solver)
    variables = model.trainable_variables
    step = compile_fn(lambda: opt.minimize(lambda: residuals(model, x, y), variables,
                                           model=model), mode)
    before = weights_of(model)
    step()
    return [a - b for a, b in zip(weights_of(model), before)], opt.linearization_used


MINIMIZE_RESIDUALS = {
    "per_example": lambda m, x, y: m(x) - y,
    # A batch mean (the taps' rows would miss its cross terms), and a layout
    # whose first axis is not the examples'.
    "batch_mean": lambda m, x, y: m(x) - tf.reduce_mean(m(x), 0) - y,
    "transposed": lambda m, x, y: tf.transpose(m(x) - y),  # [2, 12]
    # A weight itself in every residual: a path the taps do not see.
    "penalty": lambda m, x, y: m(x) - y + 0.5 * m.layers[0].kernel[0, 0],
    # A penalty row: not one row per example (refused when traced).
    "extra_row": lambda m, x, y: tf.concat(
        [m(x) - y, 0.5 * tf.reshape(m.layers[0].kernel[0, :2], [1, 2])], 0),
}


@pytest.mark.parametrize("kind,mode_", [
    ("per_example", "eager"), ("per_example", "jit"), ("batch_mean", "eager"),
    ("penalty", "jit"), ("transposed", "eager"), ("extra_row", "eager"),
    pytest.param("batch_mean", "jit", marks=pytest.mark.slow),
    pytest.param("penalty", "eager", marks=pytest.mark.slow)])
def test_minimize_checked_taps_equal_autodiff(K, gk, mode_, kind):
    residuals = MINIMIZE_RESIDUALS[kind]
    step, used = _minimize_once(K, gk, mode_, residuals, "auto")
    # (The reference eagerly: one XLA compilation fewer, the same math.)
    step_ref, used_ref = _minimize_once(K, gk, "eager", residuals, "autodiff")
    if kind == "per_example":
        assert used == "taps (checked per example)", used
    elif kind in ("extra_row", "transposed"):  # seen when traced
        assert used.startswith("autodiff: the residuals' first axis"), used
    else:  # the check failed: this call took the autodiff Jacobian
        assert used.startswith("autodiff: the residuals of `residual_fn` are not "
                               "per example"), used
    assert used_ref == "autodiff: linearization='autodiff'"
    size = max(float(np.max(np.abs(s))) for s in step_ref)
    assert size > 0
    for s, s_ref in zip(step, step_ref):  # float64: one step's round-off
        np.testing.assert_allclose(s, s_ref, atol=1e-8 * size)


def test_minimize_taps_need_a_model(K, gk):
    model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
    x = tf.constant(np.random.RandomState(0).randn(5, 3).astype("float32"))
    opt = gk.LevenbergMarquardt()
    opt.minimize(lambda: model(x), model.trainable_variables)
    assert opt.linearization_used.startswith("autodiff: minimize was given no `model=`")
    with pytest.raises(ValueError, match="linearization='taps'.*no `model=`"):
        gk.LevenbergMarquardt(linearization="taps").minimize(
            lambda: model(x), model.trainable_variables)
    with pytest.raises(ValueError, match="linearization='taps'.*matrix-free"):
        gk.LevenbergMarquardt(linearization="taps", solver="cg", scaling="levenberg") \
            .minimize(lambda: model(x), model.trainable_variables, model=model)
