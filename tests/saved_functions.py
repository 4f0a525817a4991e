"""Functions defined at a module's top level and registered with no Keras:
tf_gradkit saves them by module and qualified name, and a process that has
imported this module loads them back (tests/test_fresh_process.py). Imports
TensorFlow only, no Keras and no tf_gradkit."""

import tensorflow as tf


def mean_output_at_most_half(y_pred, batch):
    """An AugmentedLagrangian output constraint."""
    del batch
    return tf.reduce_mean(y_pred) - 0.5


def count_examples(x, y, sample_weight):
    """A GradientAccumulator ``sample_count``: the batch's examples."""
    del y, sample_weight
    return tf.shape(x)[0]


class Counts:
    """A function in a class body: its qualified name has a dot."""

    @staticmethod
    def examples(x, y, sample_weight):
        del y, sample_weight
        return tf.shape(x)[0]


def output_minus_target(model, x, y, sample_weight):
    """A LevenbergMarquardt ``residuals`` function."""
    del sample_weight
    return model(x) - y
