"""AugmentedLagrangian: the core rule against numpy, convergence to a known KKT
point, model.fit through the train-step hook, a custom GradientTape loop,
checkpoints, config and argument errors. Both flavours via the fixtures."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.core import augmented_lagrangian as rule


@pytest.fixture(scope="module")
def al(gk):
    """The flavour's package (AugmentedLagrangian, Inequality, Equality)."""
    return gk


# ------------------------------------------------------------ numpy reference
def np_terms(values, kinds, multipliers, rho):
    total = 0.0
    for v, k, m in zip(values, kinds, multipliers):
        v, m = np.asarray(v, np.float64), np.asarray(m, np.float64)
        if k == "inequality":
            # (max(0, m + rho g)^2 - m^2) / (2 rho): the textbook PHR form.
            total += np.sum((np.maximum(0.0, m + rho * v) ** 2 - m ** 2) / (2 * rho))
        else:
            total += np.sum(m * v + 0.5 * rho * v ** 2)
    return total


def np_dual(values, kinds, multipliers, rho):
    return [np.maximum(0.0, m + rho * np.asarray(v)) if k == "inequality"
            else m + rho * np.asarray(v)
            for v, k, m in zip(values, kinds, multipliers)]


VALUES = [np.array([[0.3, -0.2], [-2.0, 0.0]], np.float32), np.array([0.4, -0.1], np.float32)]
KINDS = ["inequality", "equality"]
MULTS = [np.array([[0.5, 0.5], [0.5, 0.0]], np.float32), np.array([1.0, -2.0], np.float32)]


def test_augmented_terms_and_gradient_match_numpy():
    rho = 2.0
    values = [tf.constant(v) for v in VALUES]
    with tf.GradientTape() as tape:
        tape.watch(values)
        terms = rule.augmented_terms(values, KINDS, MULTS, rho)
    np.testing.assert_allclose(float(terms), np_terms(VALUES, KINDS, MULTS, rho), rtol=1e-6)
    grads = tape.gradient(terms, values)
    # d terms / d value = the next multiplier estimate.
    for g, expected in zip(grads, np_dual(VALUES, KINDS, MULTS, rho)):
        np.testing.assert_allclose(g.numpy(), expected, rtol=1e-6)


def test_dual_update_residual_and_penalty_growth_match_numpy():
    rho = 2.0
    new = rule.dual_update(VALUES, KINDS, MULTS, rho)
    for n, e in zip(new, np_dual(VALUES, KINDS, MULTS, rho)):
        np.testing.assert_allclose(n.numpy(), e, rtol=1e-6)
    s = np.maximum(VALUES[0], -MULTS[0] / rho)
    residual = np.max([np.abs(s).max(), np.abs(VALUES[1]).max()])
    np.testing.assert_allclose(float(rule.dual_residual(VALUES, KINDS, MULTS, rho)),
                               residual, rtol=1e-6)
    assert float(rule.feasibility_violation(VALUES, KINDS)) == pytest.approx(0.4)
    assert float(rule.grow_penalty(rho, 0.3, 1.0, 10.0, 1e3, 0.25)) == 20.0  # stalled
    assert float(rule.grow_penalty(rho, 0.2, 1.0, 10.0, 1e3, 0.25)) == 2.0   # progress
    assert float(rule.grow_penalty(rho, 0.3, 1.0, 10.0, 5.0, 0.25)) == 5.0   # capped
    assert float(rule.grow_penalty(rho, 1e-8, 1e-8, 10.0, 1e3, 0.25, 1e-6)) == 2.0


def test_observe_averages_the_window_then_updates():
    shapes = [v.shape for v in VALUES]
    state = rule.init_augmented_lagrangian(shapes, 2.0)
    state = state._replace(multipliers=[tf.constant(m) for m in MULTS])
    first = [v + 1.0 for v in VALUES]
    second = [v - 1.0 for v in VALUES]  # the window mean is VALUES
    state = rule.observe(first, KINDS, state, 2, 10.0, 1e3, 0.25)
    assert int(state.dual_updates) == 0 and float(state.window_steps) == 1.0
    np.testing.assert_allclose(state.multipliers[1].numpy(), MULTS[1])
    state = rule.observe(second, KINDS, state, 2, 10.0, 1e3, 0.25)
    assert int(state.dual_updates) == 1 and float(state.window_steps) == 0.0
    for n, e in zip(state.multipliers, np_dual(VALUES, KINDS, MULTS, 2.0)):
        np.testing.assert_allclose(n.numpy(), e, rtol=1e-6, atol=1e-6)
    assert float(state.penalty) == 2.0  # first update: no reference yet
    np.testing.assert_allclose(float(state.reference_residual),
                               float(rule.dual_residual(VALUES, KINDS, MULTS, 2.0)))


def test_zero_penalty_gives_finite_values():
    values = [tf.constant(v) for v in VALUES]
    zero_mults = [np.zeros_like(m) for m in MULTS]
    for mults in (MULTS, zero_mults):
        with tf.GradientTape() as tape:
            tape.watch(values)
            terms = rule.augmented_terms(values, KINDS, mults, 0.0)
        grads = tape.gradient(terms, values)
        # rho = 0: the plain Lagrangian sum(lambda * value).
        np.testing.assert_allclose(
            float(terms), sum(np.sum(m * v) for m, v in zip(mults, VALUES)), rtol=1e-6)
        assert all(np.all(np.isfinite(g.numpy())) for g in grads)
        assert np.isfinite(float(rule.dual_residual(values, KINDS, mults, 0.0)))
    state = rule.observe(values, KINDS, rule.init_augmented_lagrangian(
        [v.shape for v in VALUES], 0.0), 1, 10.0, 1e3, 0.25)
    assert all(np.all(np.isfinite(t.numpy())) for t in tf.nest.flatten(state))
    assert float(state.penalty) == 0.0


# ------------------------------------------------------------- the optimizer
def _convex(K, al, mode, steps, **kwargs):
    """min |x - a|^2  s.t.  sum(x) == 1,  x_0 <= 0.1.

    KKT: x = (0.1, 0.9, 0.0), multiplier of the equality -0.2, of the
    inequality 1.0 (2(x - a) + mu 1 + lam e_0 = 0).
    """
    a = tf.constant([0.5, 0.8, -0.1])
    x = tf.Variable([0.0, 0.0, 0.0])
    opt = al.AugmentedLagrangian(
        K.optimizers.SGD(0.02),
        [al.Equality(lambda: tf.reduce_sum(x) - 1.0, name="sum"),
         al.Inequality(lambda: x[0] - 0.1, name="cap")], **kwargs)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(x - a))
        opt.apply_gradients(zip(tape.gradient(loss, [x]), [x]))

    step = compile_fn(step, mode)
    for _ in range(steps):
        step()
    return x, opt


def test_converges_to_kkt_point(K, al, mode):
    x, opt = _convex(K, al, mode, 400, dual_every=20, max_penalty=10.0)
    np.testing.assert_allclose(x.numpy(), [0.1, 0.9, 0.0], atol=1e-4)
    mu, lam = [m.numpy() for m in opt.multipliers]
    np.testing.assert_allclose([mu, lam], [-0.2, 1.0], atol=1e-3)
    metrics = opt.metrics()
    assert float(metrics["lagrange_violation"]) < 1e-4
    assert float(metrics["penalty"]) == 10.0  # grew from 1 once: 0.4 > 0.25
    assert int(metrics["dual_updates"]) == 20
    assert int(opt.iterations.numpy()) == 400


def test_optimizer_dual_update_by_hand(K, al, mode):
    """lr = 0 freezes x; after dual_every = 2 steps the multipliers moved by
    rho * value (rho = 3) and the window restarted."""
    x = tf.Variable([0.5, -1.0])
    opt = al.AugmentedLagrangian(
        K.optimizers.SGD(0.0),
        [al.Inequality(lambda: x), al.Equality(lambda: tf.reduce_sum(x))],
        dual_every=2, initial_penalty=3.0)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(x)
        opt.apply_gradients(zip(tape.gradient(loss, [x]), [x]))

    step = compile_fn(step, mode)
    step()
    assert all(np.all(m.numpy() == 0) for m in opt.multipliers)
    step()
    np.testing.assert_allclose(opt.multipliers[0].numpy(), [1.5, 0.0])
    np.testing.assert_allclose(opt.multipliers[1].numpy(), -1.5)
    metrics = opt.metrics()
    assert float(metrics["lagrange_violation"]) == pytest.approx(0.5)
    assert float(metrics["penalty"]) == 3.0 and int(metrics["dual_updates"]) == 1


def test_zero_initial_penalty_runs_finite(K, al):
    x, opt = _convex(K, al, "function", 20, dual_every=5, initial_penalty=0.0)
    assert np.all(np.isfinite(x.numpy()))
    assert all(np.all(np.isfinite(v.numpy())) for v in opt.variables)
    assert float(opt.penalty.numpy()) == 0.0


def _mean_capped_problem(K, n=256, seed=0):
    """y = 1 regardless of x; the output constraint mean(y_pred) <= 0.5 binds
    with multiplier 1 (d/dm of mean((m - 1)^2) at m = 0.5 is -1)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 3).astype("float32")
    y = np.ones((n, 1), "float32")
    model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
    model.set_weights([np.zeros((3, 1), "float32"), np.zeros(1, "float32")])
    return x, y, model


def mean_cap(y_pred, batch):
    del batch
    return tf.reduce_mean(y_pred) - 0.5


def test_fit_with_output_constraint_via_hook(K, al):
    x, y, model = _mean_capped_problem(K)
    opt = al.AugmentedLagrangian(K.optimizers.SGD(0.1), [al.Inequality(mean_cap)],
                                 model=model, dual_every=8, max_penalty=10.0)
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(x, y, batch_size=32, epochs=40, shuffle=False, verbose=0)
    assert {"loss", "lagrange_violation", "penalty"} <= set(history.history)
    assert history.history["lagrange_violation"][-1] < 1e-4
    assert np.mean(model.predict(x, verbose=0)) == pytest.approx(0.5, abs=1e-3)
    assert float(opt.multipliers[0].numpy()) == pytest.approx(1.0, abs=2e-2)
    # evaluate does not see the terms: its loss is the plain mse of 0.5 vs 1.
    assert model.evaluate(x, y, verbose=0) == pytest.approx(0.25, abs=2e-3)


def test_custom_loop_with_lagrangian_loss(K, al, mode):
    x, y, model = _mean_capped_problem(K)
    opt = al.AugmentedLagrangian(K.optimizers.SGD(0.1), [al.Inequality(mean_cap)],
                                 dual_every=10, max_penalty=10.0)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            y_pred = model(xb, training=True)
            loss = tf.reduce_mean(tf.square(y_pred - yb))
            loss = opt.lagrangian_loss(loss, y_pred, (xb, yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = compile_fn(step, mode)
    for _ in range(200):
        step(x, y)
    assert float(np.mean(model(x).numpy())) == pytest.approx(0.5, abs=1e-3)
    assert float(opt.multipliers[0].numpy()) == pytest.approx(1.0, abs=2e-2)


def test_output_constraint_without_a_train_step_raises(K, al):
    x, y, model = _mean_capped_problem(K)
    opt = al.AugmentedLagrangian(K.optimizers.SGD(0.1), [al.Inequality(mean_cap)])
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.raises(ValueError, match="lagrangian_loss"):
        opt.apply_gradients(zip(grads, model.trainable_variables))
    with pytest.raises(ValueError, match="y_pred"):
        opt.lagrangian_loss(tf.constant(0.0))


def test_checkpoint_round_trip(K, al, tmp_path):
    _, opt = _convex(K, al, "function", 60, dual_every=20, max_penalty=10.0)
    saved = [v.numpy() for v in opt.multipliers] + [opt.penalty.numpy()]
    assert float(opt.penalty.numpy()) == 10.0 and np.any(saved[1] != 0)
    path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "ckpt"))

    _, fresh = _convex(K, al, "eager", 1, dual_every=20, max_penalty=10.0)
    assert float(fresh.penalty.numpy()) == 1.0
    tf.train.Checkpoint(optimizer=fresh).read(path).assert_existing_objects_matched()
    restored = [v.numpy() for v in fresh.multipliers] + [fresh.penalty.numpy()]
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)
    assert int(fresh.iterations.numpy()) == 60


def test_variables_and_config(K, al):
    x = tf.Variable([1.0, 2.0])
    inner = K.optimizers.Adam(0.1)
    spec = al.Inequality(lambda: x - 1.5, name="cap")
    opt = al.AugmentedLagrangian(inner, [spec], dual_every=7, growth=3.0)
    opt.build([x])
    own = {id(v) for v in opt.variables} - {id(v) for v in inner.variables}
    assert len(opt.variables) > len(inner.variables) and own
    names = " ".join(v.name for v in opt.variables)
    assert "multiplier_0_cap" in names and "penalty" in names
    assert opt.multipliers[0].shape == (2,)
    config = opt.get_config()
    assert config["constraints"] == [{"name": "cap", "kind": "inequality",
                                      "takes_outputs": False, "shape": [2]}]
    with pytest.raises(ValueError, match="lambdas or closures, which cannot be saved"):
        type(opt).from_config(config)
    clone = type(opt).from_config(config, constraints=[spec])
    assert clone.dual_every == 7 and clone.growth == 3.0
    assert type(clone.inner_optimizer) is type(inner)
    assert float(clone.learning_rate.numpy()) == pytest.approx(0.1)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(constraints=[42]), TypeError, r"constraints\[0\]"),
    (dict(constraints=[(lambda: 1.0, "less")]), ValueError, "kind"),
    (dict(constraints=[lambda: 1.0]), TypeError, "Inequality"),
    (dict(constraints=[]), ValueError, "constraints"),
    (dict(growth=1.0), ValueError, "growth"),
    (dict(initial_penalty=-1.0), ValueError, "initial_penalty"),
    (dict(max_penalty=0.5), ValueError, "max_penalty"),
    (dict(dual_every=0), ValueError, "dual_every"),
    (dict(decrease=1.0), ValueError, "decrease"),
    (dict(learning_rate=0.1), TypeError, "unexpected"),
])
def test_bad_arguments(K, al, kwargs, error, match):
    args = dict(constraints=[al.Inequality(lambda: tf.constant(1.0))])
    args.update(kwargs)
    with pytest.raises(error, match=match):
        al.AugmentedLagrangian(K.optimizers.SGD(0.1), **args)


def test_bad_specs_and_optimizer(K, al, flavour):
    with pytest.raises(TypeError, match="fn"):
        al.Inequality("not callable")
    with pytest.raises(ValueError, match="kind"):
        al.ConstraintSpec(lambda: 1.0, "less")
    with pytest.raises(TypeError, match="two"):
        al.Equality(lambda y_pred: y_pred)
    spec = [al.Inequality(lambda: tf.constant(1.0))]
    with pytest.raises(TypeError, match="optimizer"):
        al.AugmentedLagrangian(tf.Module(), spec)
    # An object of no Keras flavour: refused, with no other flavour's class
    # suggested (test_host_contract checks the suggestion for the other
    # flavour's optimizer).
    with pytest.raises(TypeError, match="optimizer=builtins.object") as refused:
        al.AugmentedLagrangian(object(), spec)
    assert "other flavour" not in str(refused.value)
    with pytest.raises(TypeError, match="LossScaleOptimizer"):
        al.AugmentedLagrangian(K.mixed_precision.LossScaleOptimizer(
            K.optimizers.SGD(0.1)), spec)


@pytest.mark.distributed
def test_mirrored_strategy_fit_equals_single_device(K, gk, mirrored):
    """Constraints on variables: replicas take the identical step. Output
    constraints are evaluated on each replica's share of the batch (a
    per-batch estimate, like the loss), so there we check the end result."""
    import tf_gradkit  # noqa: PLC0415

    rng = np.random.RandomState(0)
    x = rng.randn(128, 3).astype("float32")
    t = (x @ np.ones((3, 1)) + 1.0).astype("float32")  # pulls |W|^2 to 3

    def run(scope, output_cap):
        with scope:
            model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
            model.set_weights([np.full((3, 1), 0.1, "float32"), np.zeros(1, "float32")])
            kernel = model.layers[0].kernel
            specs = [tf_gradkit.Inequality(
                lambda: tf.reduce_sum(tf.square(kernel)) - 0.5, name="norm")]
            if output_cap:
                specs.append(tf_gradkit.Inequality(
                    lambda y_pred, batch: tf.reduce_mean(y_pred) - 0.5, name="cap"))
            opt = gk.AugmentedLagrangian(K.optimizers.SGD(0.05), specs, model=model,
                                         max_penalty=10.0, dual_every=4)
            model.compile(optimizer=opt, loss="mse")
        model.fit(x, t, batch_size=32, epochs=8 if output_cap else 15,
                  shuffle=False, verbose=0)
        return model, {k: float(v) for k, v in opt.metrics().items()}

    ref, ref_m = run(contextlib.nullcontext(), False)
    got, got_m = run(mirrored.scope(), False)
    assert ref_m["multipliers/norm"] > 0.1  # the constraint binds
    # Two replicas sum half-batch gradients: float32 summation order only.
    for a, b in zip(ref.get_weights(), got.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for key in ("penalty", "dual_updates", "multipliers/norm"):
        np.testing.assert_allclose(got_m[key], ref_m[key], rtol=1e-4)

    single, _ = run(contextlib.nullcontext(), True)
    model, _ = run(mirrored.scope(), True)
    means = [float(np.mean(m.predict(x, verbose=0))) for m in (single, model)]
    # Both head for the cap (unconstrained mean: 1.0); the per-replica
    # estimate (16 rows vs 32) only changes the noise.
    assert all(m < 0.6 for m in means)
    assert abs(means[0] - means[1]) < 0.03
