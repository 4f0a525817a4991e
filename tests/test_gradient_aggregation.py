"""Weighted aggregation of gradient or delta sets (`gradients.aggregation`),
against the weighted sum done by hand, and FedAvg through GradientAccumulator's
window."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.gradients.aggregation import weighted_average

# float32 sums of K = 3 terms: a few units of round-off on values of order 1.
TOL = 1e-6


def _sets(seed=0, num_sets=3):
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=(4, 3)).astype("float32"),
             rng.normal(size=(3,)).astype("float32")] for _ in range(num_sets)]


def _by_hand(sets, weights):
    """sum_k w_kj g_kj / sum_k w_kj per variable j, in float64."""
    out = []
    for j in range(len(sets[0])):
        num = sum(np.float64(weights[k][j]) * sets[k][j].astype("float64")
                  for k in range(len(sets)))
        out.append(num / sum(weights[k][j] for k in range(len(sets))))
    return out


@pytest.mark.keras_free
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_weighted_mean_per_set_and_per_variable(mode):
    sets = _sets()
    counts = [5.0, 1.0, 2.0]
    fn = compile_fn(lambda s, w: weighted_average(s, w), mode)
    got = fn([[tf.constant(g) for g in s] for s in sets], tf.constant(counts))
    want = _by_hand(sets, [[c, c] for c in counts])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=0, atol=TOL)
    # One weight per set and per variable (per-layer counts).
    per_var = [[5.0, 1.0], [1.0, 0.0], [2.0, 3.0]]
    got = weighted_average(sets, per_var)
    for g, w in zip(got, _by_hand(sets, per_var)):
        np.testing.assert_allclose(g.numpy(), w, rtol=0, atol=TOL)
    # The weighted sum.
    got = weighted_average(sets, counts, normalize=False)
    for j, g in enumerate(got):
        np.testing.assert_allclose(
            g.numpy(), sum(c * s[j] for c, s in zip(counts, sets)), rtol=0, atol=1e-5)


@pytest.mark.keras_free
def test_missing_gradients_do_not_count_and_zero_weights_give_zeros():
    sets = _sets()
    sets[1][0] = None  # set 1 has no gradient for variable 0
    got = weighted_average(sets, [5.0, 1.0, 2.0])
    want0 = (5.0 * sets[0][0] + 2.0 * sets[2][0]) / 7.0
    np.testing.assert_allclose(got[0].numpy(), want0, rtol=0, atol=TOL)
    got = weighted_average(sets, [0.0, 0.0, 0.0])
    assert all(np.all(g.numpy() == 0.0) for g in got)
    assert weighted_average([[None], [None]], [1.0, 2.0]) == [None]


@pytest.mark.keras_free
@pytest.mark.parametrize("args,match", [
    (([], [1.0]), r"`sets` must be a non-empty list.*Received: sets=\[\]"),
    ((None, [1.0]), r"Received: sets=None"),
    (([[1.0], [1.0, 2.0]], [1.0, 1.0]), r"sets\[1\] differs"),
    (([[1.0], [2.0]], [1.0]), r"one entry per set \(2\)\. Received: 1 entries"),
    (([[1.0], [2.0]], [1.0, -1.0]), r"non-negative.*weights\[1\] containing -1.0"),
    (([[1.0], [2.0]], [[1.0, 2.0], [1.0]]), r"weights\[0\] has 2 entries.*\(1\)"),
    (([[1.0], [2.0]], tf.ones([3])), r"shape \[2\].*Received: shape \[3\]"),
])
def test_bad_input_is_named(args, match):
    with pytest.raises(ValueError, match=match):
        weighted_average(*args)


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_fedavg_of_deltas_through_the_accumulator_window(K, gk, mode):
    """Three clients' weight deltas, weighted by their example counts: the
    accumulator around SGD(1.0), fed -delta_k with sample_count=n_k, moves
    the server's weights by the weighted mean delta, once."""
    rng = np.random.default_rng(1)
    w0 = [rng.normal(size=(4, 3)).astype("float32"), np.zeros(3, "float32")]
    server = [tf.Variable(w) for w in w0]
    deltas = _sets(seed=2)
    counts = [50, 10, 20]
    opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=3)

    def client_round(delta, n):
        opt.apply_gradients(zip([-d for d in delta], server), sample_count=n)

    step = compile_fn(client_round, mode)
    for k, (delta, n) in enumerate(zip(deltas, counts)):
        step([tf.constant(d) for d in delta], tf.constant(n, tf.float32))
        if k < 2:  # the window is still open: the server has not moved
            for v, w in zip(server, w0):
                np.testing.assert_array_equal(v.numpy(), w)
    mean = _by_hand(deltas, [[n, n] for n in counts])
    for v, w, d in zip(server, w0, mean):
        np.testing.assert_allclose(v.numpy(), w + d, rtol=0, atol=4 * TOL)
    # ... and the same as weighted_average's mean.
    for d, got in zip(mean, weighted_average(deltas, counts)):
        np.testing.assert_allclose(got.numpy(), d, rtol=0, atol=TOL)


def test_weighted_gradients_through_any_inner_optimizer(K, gk):
    """With Adam inside, the window applies Adam once to the weighted mean
    gradient: the same as Adam given weighted_average's result."""
    sets = _sets(seed=3)
    counts = [3.0, 1.0, 4.0]
    a = [tf.Variable(np.ones((4, 3), "float32")), tf.Variable(np.ones(3, "float32"))]
    b = [tf.Variable(np.ones((4, 3), "float32")), tf.Variable(np.ones(3, "float32"))]
    acc = gk.GradientAccumulator(K.optimizers.Adam(0.1), steps=3)
    for g, n in zip(sets, counts):
        acc.apply_gradients(zip([tf.constant(x) for x in g], a), sample_count=n)
    K.optimizers.Adam(0.1).apply_gradients(zip(weighted_average(sets, counts), b))
    for va, vb in zip(a, b):
        # Adam's first step moves each weight by ~lr * sign(g): both match
        # to float32 round-off of the same arithmetic on equal gradients.
        np.testing.assert_allclose(va.numpy(), vb.numpy(), rtol=0, atol=1e-6)
