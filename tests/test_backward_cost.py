"""`gradients.backward_cost`: FLOPs of the forward and backward passes,
checked against the products counted by hand."""

import pytest
import tensorflow as tf

from tf_gradkit.gradients.cost import BackwardCost, backward_cost, graph_flops


def _mlp(K, d, hidden, out):
    return K.Sequential([K.Input((d,)), K.layers.Dense(hidden, activation="tanh"),
                         K.layers.Dense(out)])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_dense_flops_are_the_products_counted_by_hand(K, jit_compile):
    m, d, h, o = 32, 8, 16, 4
    model = _mlp(K, d, h, o)
    x, y = tf.random.normal([m, d]), tf.random.normal([m, o])

    def loss_fn(x, y):
        return tf.reduce_mean(tf.square(model(x, training=True) - y))

    cost = backward_cost(loss_fn, model.trainable_variables, x, y,
                         jit_compile=jit_compile, repeats=3)
    assert isinstance(cost, BackwardCost)
    # A [m, k] x [k, n] product is 2 m k n FLOPs. Forward: x W1 and h W2.
    forward = 2 * m * d * h + 2 * m * h * o
    # Backward: dW2 = h^T g, dh = g W2^T, dW1 = x^T g1; no dx (x is data).
    backward = 2 * h * m * o + 2 * m * o * h + 2 * d * m * h
    total_matmul = cost.flops_by_op["MatMul"]
    assert total_matmul == forward + backward
    # The element-wise ops with registered statistics (bias adds, the
    # loss's mean and squares) add a few FLOPs per element, no products.
    assert forward <= cost.forward_flops <= forward + 20 * m * (h + o)
    assert backward <= cost.backward_flops <= backward + 20 * m * (h + o)
    assert cost.forward_ms > 0 and cost.backward_ms >= 0
    assert "backward" in str(cost) and cost.flops_ratio == pytest.approx(
        cost.backward_flops / cost.forward_flops)


def test_conv_backward_counts_input_and_filter_gradients(K):
    # TensorFlow's graph computes dL/d(input) of every convolution, the first
    # one's too (its input is data): each conv pays a filter gradient and an
    # input gradient, each at least its forward's products.
    model = K.Sequential([K.Input((8, 8, 1)), K.layers.Conv2D(4, 3),
                          K.layers.Conv2D(4, 3), K.layers.Flatten(),
                          K.layers.Dense(2)])
    x = tf.random.normal([16, 8, 8, 1])
    forward_fn = tf.function(lambda x: tf.reduce_sum(model(x)))
    _, forward_ops = graph_flops(forward_fn, x)
    # Each output element of a 3x3 conv over c_in channels: 2 * 9 * c_in FLOPs.
    conv1 = 2 * 16 * 6 * 6 * 4 * 9 * 1
    conv2 = 2 * 16 * 4 * 4 * 4 * 9 * 4
    assert forward_ops["Conv2D"] == conv1 + conv2
    cost = backward_cost(lambda x: tf.reduce_sum(model(x)), model.trainable_variables,
                         x, repeats=2)
    by_op = cost.flops_by_op
    # TensorFlow's statistic for an input gradient is the full convolution
    # of the output gradient with the filter, evaluated at every input
    # position: 2 * 9 * c_out FLOPs per input element.
    assert by_op["Conv2DBackpropInput"] == 2 * 9 * 4 * (16 * 8 * 8 * 1 + 16 * 6 * 6 * 4)
    assert by_op["Conv2DBackpropFilter"] >= conv1 + conv2
    assert cost.backward_flops >= 2 * (conv1 + conv2)


@pytest.mark.parametrize("kwargs,match", [
    ({"variables": []}, r"`variables` is empty"),
    ({"repeats": 0}, r"`repeats` must be an integer >= 1. Received: repeats=0"),
    ({"repeats": True}, r"Received: repeats=True"),
])
def test_bad_input_is_named(kwargs, match):
    w = tf.Variable(1.0)
    args = {"variables": [w], **kwargs}
    with pytest.raises(ValueError, match=match):
        backward_cost(lambda x: w * x, args.pop("variables"), tf.constant(1.0), **args)
