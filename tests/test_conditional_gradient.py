"""ConditionalGradient (Frank-Wolfe): the core oracles against numpy, one
hand-computed step per set, feasibility over many steps, training in every
mode, the tensorflow-addons formula, sparse gradients, per-variable radii,
config round trip and argument errors. Runs under the process's Keras flavour."""

import copy

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR, compile_fn
from helpers import embedding_model, mlp, regression_data
from tf_gradkit.core import frank_wolfe as fw

ORDS = ("fro", "nuclear", "l1", "linf", "k_sparse")

# Most checks compare float32 TensorFlow with float64 numpy on O(1) entries
# built from a handful of sums; 1e-5 is ~100x float32 round-off there and far
# below any wrong formula (a wrong sign, vertex or normalisation is O(0.1)).
TOL = 1e-5


def _rand(shape, seed=0):
    return np.random.RandomState(seed).randn(*shape).astype("float32")


def _vertex_np(g, r, ord, k=None, eps=1e-7):
    """The LMO vertex argmin_{|z| <= r} <g, z>, in float64 numpy."""
    g = g.astype("float64")
    flat = g.ravel()
    if ord == "fro" or (ord == "nuclear" and g.ndim < 2):
        return -r * g / (np.linalg.norm(flat) + eps)
    if ord == "nuclear":
        u, _, vt = np.linalg.svd(g.reshape(-1, g.shape[-1]))
        return (-r * np.outer(u[:, 0], vt[0])).reshape(g.shape)
    out = np.zeros_like(flat)
    if ord == "l1":
        i = np.argmax(np.abs(flat))
        out[i] = -r * np.sign(flat[i])
    elif ord == "linf":
        out = -r * np.sign(flat)
    else:  # k_sparse
        top = np.argsort(-np.abs(flat))[:k]
        out[top] = -r * np.sign(flat[top])
    return out.reshape(g.shape)


def _norm_np(w, ord, k=None):
    """The gauge of the set: w is feasible for radius r iff this <= r."""
    w = np.asarray(w, "float64")
    if ord == "fro" or (ord == "nuclear" and w.ndim < 2):
        return np.linalg.norm(w.ravel())
    if ord == "nuclear":
        return np.linalg.svd(w.reshape(-1, w.shape[-1]), compute_uv=False).sum()
    if ord == "l1":
        return np.abs(w).sum()
    if ord == "linf":
        return np.abs(w).max()
    return np.max([np.abs(w).max(), np.abs(w).sum() / k])  # k_sparse


def _matrix_with_gap(m, n, ratio=0.5, seed=0):
    """A matrix whose singular values fall geometrically by `ratio`: power
    iteration then converges in angle like ratio^(2 * iterations)."""
    rng = np.random.RandomState(seed)
    u, _ = np.linalg.qr(rng.randn(m, m))
    v, _ = np.linalg.qr(rng.randn(n, n))
    sigma = 3.0 * ratio ** np.arange(min(m, n))
    return (u[:, :len(sigma)] * sigma) @ v[:, :len(sigma)].T


# --- core oracles ------------------------------------------------------------

def test_core_oracles_match_numpy_and_are_optimal(mode):
    g = _rand((4, 5))
    r = 1.7
    run = compile_fn(lambda g: (fw.lmo_frobenius(g, r), fw.lmo_l1(g, r),
                                fw.lmo_linf(g, r), fw.lmo_k_sparse(g, r, 3)), mode)
    fro, l1, linf, ks = [t.numpy() for t in run(tf.constant(g))]
    for got, ord in ((fro, "fro"), (l1, "l1"), (linf, "linf"), (ks, "k_sparse")):  # noqa: A001
        np.testing.assert_allclose(got, _vertex_np(g, r, ord, k=3), atol=TOL)
    # Each vertex attains -r * (dual norm of g): the minimum of <g, z> over the set.
    a = np.abs(g.ravel())
    np.testing.assert_allclose(
        [np.sum(g * fro), np.sum(g * l1), np.sum(g * linf), np.sum(g * ks)],
        [-r * np.linalg.norm(a), -r * a.max(), -r * a.sum(), -r * np.sort(a)[-3:].sum()],
        rtol=TOL)
    # The Frank-Wolfe gap <g, w - s> >= 0 for any feasible w (here w = 0).
    w = np.zeros_like(g)
    assert float(fw.frank_wolfe_gap(g, w, l1)) == pytest.approx(-np.sum(g * l1), rel=TOL)
    assert float(fw.frank_wolfe_gap(g, w, l1)) >= 0
    # k >= size is the linf vertex; a zero gradient gives a feasible 0.
    np.testing.assert_allclose(fw.lmo_k_sparse(g, r, 100).numpy(), linf, atol=0)
    assert not np.any(fw.lmo_frobenius(tf.zeros((3, 2)), r).numpy())


def test_nuclear_power_iteration_matches_numpy_svd(mode):
    # sigma2/sigma1 = 0.5 and 30 iterations: angle error ~ 0.25^30 ~ 1e-18,
    # so only float32 round-off (TOL) remains. Covers a rank-4 kernel too.
    for shape in ((6, 5), (3, 3, 2, 4)):
        g = _matrix_with_gap(int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
        v0 = fw.initial_singular_vector(shape[-1])
        run = compile_fn(lambda g, v: fw.lmo_nuclear(g, 2.0, v, iterations=30), mode)
        s, v = run(tf.constant(g, tf.float32), v0)
        np.testing.assert_allclose(s.numpy(), _vertex_np(g, 2.0, "nuclear"), atol=TOL)
        assert v.shape == (shape[-1],)
        assert np.linalg.norm(v.numpy()) == pytest.approx(1.0, abs=TOL)


def test_nuclear_warm_start_tracks_the_top_pair():
    # Two iterations a step, the vector carried over: after 10 steps on the
    # same gradient it has done 20 iterations, as good as a cold start of 20.
    g = tf.constant(_matrix_with_gap(8, 6, ratio=0.5, seed=3), tf.float32)
    v = fw.initial_singular_vector(6)
    cold, _ = fw.lmo_nuclear(g, 1.0, v, iterations=2)
    for _ in range(10):
        s, v = fw.lmo_nuclear(g, 1.0, v, iterations=2)
    exact = _vertex_np(g.numpy(), 1.0, "nuclear")
    np.testing.assert_allclose(s.numpy(), exact, atol=TOL)
    assert np.abs(cold.numpy() - exact).max() > 10 * TOL  # 2 cold iterations: not yet
    # Zero gradient: vertex 0, vector kept. A start orthogonal to the row space
    # restarts from the largest row instead of returning 0.
    s0, v0 = fw.lmo_nuclear(tf.zeros((8, 6)), 1.0, v)
    assert not np.any(s0.numpy()) and np.array_equal(v0.numpy(), v.numpy())
    rank1 = tf.constant(np.outer(np.arange(1.0, 5.0), [1.0, 0.0, 0.0]), tf.float32)
    s1, _ = fw.lmo_nuclear(rank1, 1.0, tf.constant([0.0, 1.0, 0.0]))
    np.testing.assert_allclose(s1.numpy(), _vertex_np(rank1.numpy(), 1.0, "nuclear"),
                               atol=TOL)


# --- the optimizer: one step by hand -----------------------------------------

def _layer(K, kind, seed=0):
    if kind == "dense":
        layer = K.layers.Dense(5)
        layer.build((None, 4))
    else:
        layer = K.layers.Conv2D(4, 3)
        layer.build((None, 6, 6, 2))
    layer.set_weights([_rand(w.shape, seed + i) * 0.1
                       for i, w in enumerate(layer.get_weights())])
    return layer


@pytest.mark.parametrize("ord", ORDS)
def test_one_step_matches_hand_computation(K, gk, ord, mode):
    lr, r, k = 0.3, 1.5, 3
    layers = [_layer(K, "dense"), _layer(K, "conv", seed=5)]
    variables = [v for layer in layers for v in layer.trainable_variables]
    w0 = [v.numpy() for v in variables]
    grads = [_matrix_with_gap(int(np.prod(w.shape[:-1])), w.shape[-1], seed=i)
             .reshape(w.shape).astype("float32") if w.ndim >= 2
             else _rand(w.shape, seed=i) for i, w in enumerate(w0)]
    opt = gk.ConditionalGradient(lr, lambda_=r, ord=ord,
                                 k=k if ord == "k_sparse" else None,
                                 power_iterations=30)
    step = compile_fn(lambda gs: opt.apply_gradients(zip(gs, variables)), mode)
    step([tf.constant(g) for g in grads])
    for v, w, g in zip(variables, w0, grads):
        expected = (1 - lr) * w + lr * _vertex_np(g, r, ord, k=k)
        np.testing.assert_allclose(v.numpy(), expected, atol=TOL, err_msg=v.name)
    if ord == "nuclear":  # kernels keep a (last dim,) vector; biases none
        assert sorted(tuple(x.shape) for x in opt.variables if len(x.shape)) == [(4,), (5,)]


@pytest.mark.parametrize("ord", ORDS)
def test_iterates_stay_feasible(K, gk, ord):
    # Start strictly inside the set, take 40 steps with random gradients and a
    # big step (0.5): every iterate is a convex combination of feasible points.
    r, k = 0.8, 3
    layers = [_layer(K, "dense"), _layer(K, "conv", seed=5)]
    variables = [v for layer in layers for v in layer.trainable_variables]
    for v in variables:
        w = v.numpy()
        v.assign(w * 0.5 * r / _norm_np(w, ord, k))
    opt = gk.ConditionalGradient(0.5, lambda_=r, ord=ord,
                                 k=k if ord == "k_sparse" else None)
    step = compile_fn(lambda gs: opt.apply_gradients(zip(gs, variables)), "function")
    rng = np.random.RandomState(0)
    for _ in range(40):
        step([tf.constant(rng.randn(*v.shape), tf.float32) for v in variables])
        for v in variables:
            assert _norm_np(v.numpy(), ord, k) <= r * (1 + 1e-5), v.name


def test_tensorflow_addons_formula(K, gk):
    # tfa (0.20, `_resource_apply_dense`):
    #   s = g / (|g|_F + eps)         (fro)    or   u1 v1^T   (nuclear)
    #   w <- lr_tfa * w - (1 - lr_tfa) * lambda_ * s
    # i.e. tfa's learning_rate weighs the old iterate; ours is the step size,
    # w <- (1 - lr) w - lr * lambda_ * s, so lr = 1 - lr_tfa gives tfa's update.
    lr_tfa, lam, eps = 0.8, 0.7, 1e-7
    g = _matrix_with_gap(4, 5, seed=2).astype("float32")
    u, _, vt = np.linalg.svd(g)
    for ord, s in (("fro", g / (np.linalg.norm(g) + eps)),  # noqa: A001
                   ("nuclear", np.outer(u[:, 0], vt[0]))):
        layer = _layer(K, "dense")
        w0 = layer.kernel.numpy()
        opt = gk.ConditionalGradient(1 - lr_tfa, lambda_=lam, epsilon=eps, ord=ord,
                                     power_iterations=30)
        opt.apply_gradients([(tf.constant(g), layer.kernel)])
        tfa = lr_tfa * w0 - (1 - lr_tfa) * lam * s
        np.testing.assert_allclose(layer.kernel.numpy(), tfa, atol=TOL)


# --- training ------------------------------------------------------------------

def _mse(model, x, y):
    return float(np.mean((model(x).numpy() - y) ** 2))


@pytest.mark.parametrize("ord", ("fro", "nuclear"))
def test_fit_lowers_loss(K, gk, ord, mode):
    x, y = regression_data(n=64)
    model = mlp(K, hidden=8)
    model.compile(optimizer=gk.ConditionalGradient(0.1, lambda_=3.0, ord=ord),
                  loss="mse", run_eagerly=(mode == "eager"),
                  jit_compile=(mode == "jit"))
    before = _mse(model, x, y)
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)
    assert _mse(model, x, y) < 0.8 * before


def test_custom_loop_lowers_loss(K, gk, mode):
    x, y = regression_data(n=64)
    model = mlp(K, hidden=8)
    opt = gk.ConditionalGradient(0.1, lambda_={"kernel": 3.0, "bias": 1.0},
                                 ord="nuclear")

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = compile_fn(step, mode)
    before = _mse(model, x, y)
    for _ in range(4):
        for i in range(0, 64, 16):
            step(x[i:i + 16], y[i:i + 16])
    assert _mse(model, x, y) < 0.8 * before


def test_conv_model_with_nuclear_ball(K, gk):
    # The rank-4 kernel (3, 3, 2, 4) is constrained as an (18, 4) matrix.
    rng = np.random.RandomState(0)
    x = rng.randn(64, 6, 6, 2).astype("float32")
    y = 5.0 * x[..., :1].mean(axis=(1, 2))
    model = K.Sequential([K.Input((6, 6, 2)), K.layers.Conv2D(4, 3, activation="tanh"),
                          K.layers.GlobalAveragePooling2D(), K.layers.Dense(1)])
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.3
                       for w in model.get_weights()])
    r = 3.0
    opt = gk.ConditionalGradient(0.05, lambda_=r, ord="nuclear")
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    before = _mse(model, x, y)
    model.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0)
    assert _mse(model, x, y) < 0.5 * before
    kernel = model.layers[0].kernel.numpy()
    assert kernel.shape == (3, 3, 2, 4)
    assert _norm_np(kernel, "nuclear") <= r * (1 + 1e-5)
    assert (4,) in [tuple(v.shape) for v in opt.variables]


def test_sparse_gradient_is_densified(K, gk, mode):
    x = np.random.RandomState(0).randint(0, 50, size=(8, 5)).astype("int32")
    x[:, 0] = 7  # duplicate indices, which must be summed
    y = np.ones((8, 1), "float32")
    results = []
    for densify in (False, True):
        model = embedding_model(K)
        opt = gk.ConditionalGradient(0.3, lambda_=2.0, ord="nuclear")

        def step(xb, yb, model=model, opt=opt, densify=densify):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            if densify:
                grads = [tf.convert_to_tensor(g) for g in grads]
            else:
                assert isinstance(grads[0], tf.IndexedSlices)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        compile_fn(step, mode)(x, y)
        results.append([w.numpy() for w in model.trainable_variables])
    for sparse, dense in zip(*results):
        np.testing.assert_allclose(sparse, dense, atol=TOL)


def test_per_variable_radii(K, gk):
    layer = _layer(K, "dense")
    for v in layer.trainable_variables:
        v.assign(tf.zeros_like(v))
    # First matching pattern wins: "dense.*kernel" before ".*".
    opt = gk.ConditionalGradient(1.0, lambda_={"kernel": 2.0, ".*": 0.5})
    grads = [tf.constant(_rand(v.shape, i)) for i, v in enumerate(layer.trainable_variables)]
    opt.apply_gradients(zip(grads, layer.trainable_variables))
    assert np.linalg.norm(layer.kernel.numpy()) == pytest.approx(2.0, rel=TOL)
    assert np.linalg.norm(layer.bias.numpy()) == pytest.approx(0.5, rel=TOL)


def test_radius_patterns_must_match(K, gk):
    layer = _layer(K, "dense")
    opt = gk.ConditionalGradient(0.1, lambda_={"kernel": 1.0, "kernal": 2.0, ".*": 1.0})
    with pytest.raises(ValueError, match="'kernal'.*match no variable"):
        opt.build(layer.trainable_variables)
    opt = gk.ConditionalGradient(0.1, lambda_={"kernel": 1.0})
    with pytest.raises(ValueError, match="bias.*matches no `lambda_` pattern"):
        opt.build(layer.trainable_variables)


def test_config_round_trip(K, gk):
    schedule = K.optimizers.schedules.ExponentialDecay(0.5, 10, 0.9)
    opt = gk.ConditionalGradient(schedule, lambda_={"kernel": 3.0, ".*": 1.0},
                                 ord="k_sparse", k=4, epsilon=1e-6, clipnorm=1.0)
    config = opt.get_config()
    clone = type(opt).from_config(copy.deepcopy(config))  # Keras edits it in place
    assert clone.get_config() == config
    assert (clone.lambda_, clone.ord, clone.k) == ({"kernel": 3.0, ".*": 1.0}, "k_sparse", 4)
    plain = gk.ConditionalGradient(0.25, lambda_=0.5, ord="nuclear", power_iterations=3)
    assert type(plain).from_config(plain.get_config()).get_config() == plain.get_config()
    revived = K.optimizers.deserialize(K.optimizers.serialize(opt))
    assert type(revived) is type(opt)
    assert revived.get_config()["lambda_"] == config["lambda_"]


def test_nuclear_state_is_checkpointed(K, gk, tmp_path):
    x, y = regression_data(n=16)
    model = mlp(K)
    opt = gk.ConditionalGradient(0.1, lambda_=5.0, ord="nuclear")
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "c"))
    fresh_model = mlp(K)
    fresh = gk.ConditionalGradient(0.1, lambda_=5.0, ord="nuclear")
    fresh.build(fresh_model.trainable_variables)
    tf.train.Checkpoint(optimizer=fresh).restore(path).assert_existing_objects_matched()
    vectors = [[v.numpy() for v in o.variables if len(v.shape)] for o in (opt, fresh)]
    assert len(vectors[0]) == 2
    for a, b in zip(*vectors):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(learning_rate=1.5), r"`learning_rate`.*\[0, 1\].*Received: learning_rate=1.5"),
    (dict(lambda_=-1.0), r"`lambda_` is a radius.*>= 0.*Received: lambda_=-1.0"),
    (dict(lambda_="big"), r"`lambda_`.*Received: lambda_='big'"),
    (dict(lambda_={}), r"`lambda_`.*at least one"),
    (dict(lambda_={"(": 1.0}), r"pattern '\(' is not a valid regular expression"),
    (dict(lambda_={"kernel": -2.0}), r"`lambda_\['kernel'\]`.*Received: lambda_\['kernel'\]=-2.0"),
    (dict(ord="spectral"), r"`ord` must be one of \['fro', 'nuclear', 'l1', 'linf', 'k_sparse'\]. Received: ord='spectral'"),
    (dict(ord="k_sparse"), r"needs `k`, an integer >= 1.*Received: k=None"),
    (dict(ord="k_sparse", k=0), r"Received: k=0"),
    (dict(k=3), r"`k` only applies to ord='k_sparse'. Received: k=3 with ord='fro'"),
    (dict(power_iterations=0), r"`power_iterations` must be an integer >= 1. Received: power_iterations=0"),
    (dict(epsilon=-1.0), r"`epsilon` must be a float >= 0. Received: epsilon=-1.0"),
])
def test_bad_arguments(gk, kwargs, message):
    kwargs = {"learning_rate": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        gk.ConditionalGradient(**kwargs)


def test_flavour_and_registration(gk):
    opt = gk.ConditionalGradient(0.1)
    assert type(opt).__module__ == f"tf_gradkit.{FLAVOUR}"  # made by the flavour package
    assert "Jaggi" in type(opt).__doc__
