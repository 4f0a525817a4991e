"""Loss-scale optimizers and our wrappers under a mixed_float16 policy, both
flavours (issue 27, item 4): each order is exact or refused, naming the
order that works."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR
from helpers import max_abs_diff, mlp, regression_data, weights_of
from tf_gradkit import constraints as C


@pytest.fixture
def mixed(K):
    policy = K.mixed_precision.global_policy()
    K.mixed_precision.set_global_policy("mixed_float16")
    yield
    K.mixed_precision.set_global_policy(policy)


WRAPPED = {
    "GradientAccumulator": lambda gk, inner, model: gk.GradientAccumulator(
        inner, 2, model=model),
    "Projected": lambda gk, inner, model: gk.Projected(inner, {"kernel": C.NonNeg()}),
    "MagnitudePruning": lambda gk, inner, model: gk.MagnitudePruning(
        inner, model=model, targets=[model.trainable_variables[0]],
        schedule=__import__("tf_gradkit.pruning", fromlist=["x"]).ConstantSparsity(
            0.5, 1, 1, 1)),
}


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_a_loss_scale_optimizer_inside_a_wrapper_is_refused_under_mixed_precision(
        K, gk, mixed, name):
    # compile would wrap the wrapper in a second loss-scale optimizer
    # (tf_keras silently): refused, naming the order that works.
    model = mlp(K)
    before = weights_of(model)
    match = (rf"{name}.*LossScaleOptimizer.*(twice|outside).*"
             rf"LossScaleOptimizer\({name}\(optimizer" if FLAVOUR == "tf_keras" else
             rf"{name} cannot wrap LossScaleOptimizer.*outside")
    with pytest.raises(TypeError, match=match):
        opt = WRAPPED[name](gk, K.mixed_precision.LossScaleOptimizer(
            K.optimizers.Adam(0.05)), model)
        model.compile(optimizer=opt, loss="mse")
    assert max_abs_diff(before, weights_of(model)) == 0


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_the_order_that_works_trains_under_mixed_precision(K, gk, mixed, name):
    x, y = regression_data(n=16)
    model = mlp(K)
    opt = WRAPPED[name](gk, K.optimizers.Adam(0.05), model)
    model.compile(optimizer=opt, loss="mse")
    assert isinstance(model.optimizer, K.mixed_precision.LossScaleOptimizer)
    history = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    if name == "MagnitudePruning":  # half the first kernel pruned
        kernel = model.trainable_variables[0].numpy()
        assert np.sum(kernel == 0) == kernel.size // 2


def test_skipped_micro_batches_count_no_update_in_a_custom_loop(K, gk):
    # LossScaleOptimizer(GradientAccumulator(Adam, 4)): a micro-batch that
    # overflows is skipped by the loss-scale optimizer; tf_keras's counts a
    # skipped step in its inner optimizer's iterations, which must not make
    # the accumulator (or Adam) count an update that never happened.
    x, y = regression_data()
    model = mlp(K)
    adam = K.optimizers.Adam(0.05)
    acc = gk.GradientAccumulator(adam, 4, reduction="microbatch")
    lso = K.mixed_precision.LossScaleOptimizer(acc)
    before = weights_of(model)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = (lso.scale_loss(loss) if FLAVOUR == "keras3"
                      else lso.get_scaled_loss(loss))
        grads = tape.gradient(scaled, model.trainable_variables)
        if FLAVOUR == "tf_keras":
            grads = lso.get_unscaled_gradients(grads)
        lso.apply_gradients(zip(grads, model.trainable_variables))

    bad = y[:8].copy()
    bad[0] = np.inf
    for _ in range(12):
        step(x[:8], bad)
    assert int(acc.iterations.numpy()) == 0
    assert int(lso.iterations.numpy()) == 0
    assert int(adam.iterations.numpy()) == 0
    assert int(acc.micro_steps.numpy()) == 0
    assert max_abs_diff(before, weights_of(model)) == 0
    for i in range(4):
        step(x[i * 4:i * 4 + 4], y[i * 4:i * 4 + 4])
    assert int(acc.iterations.numpy()) == 1 and int(adam.iterations.numpy()) == 1
    assert int(lso.iterations.numpy()) == 1


def test_skipped_micro_batches_count_no_update_under_fit(K, gk, mixed):
    x, y = regression_data(n=24)
    bad = y.copy()
    bad[:] = np.inf  # every micro-batch overflows
    model = mlp(K)
    acc = gk.GradientAccumulator(K.optimizers.Adam(0.05), 4, model=model,
                                 epoch_end="carry")
    model.compile(optimizer=acc, loss="mse")
    before = weights_of(model)
    model.fit(x, bad, batch_size=2, epochs=1, shuffle=False, verbose=0)
    assert int(acc.iterations.numpy()) == 0
    assert int(model.optimizer.iterations.numpy()) == 0
    assert int(acc.inner_optimizer.iterations.numpy()) == 0
    assert max_abs_diff(before, weights_of(model)) == 0
