"""Scientific curve fitting with tf_gradkit.least_squares (float64, one XLA loop).

Run: .venv/bin/python examples/lm_curve_fit.py   (a few seconds)

Fits the NIST StRD Misra1a model y = b1 * (1 - exp(-b2 * x)) to its data and
compares with the certified values: both parameters agree to 10 digits.
"""

import numpy as np
import tensorflow as tf

import tf_gradkit

# NIST StRD Misra1a (public domain): x, y and the certified values.
X = [77.6, 114.9, 141.1, 190.8, 239.9, 289.0, 332.8, 378.4, 434.8, 477.3,
     536.8, 593.1, 689.1, 760.0]
Y = [10.07, 14.73, 17.94, 23.93, 29.61, 35.18, 40.02, 44.82, 50.76, 55.05,
     61.01, 66.40, 75.47, 81.78]
CERTIFIED = [2.3894212918e02, 5.5015643181e-04]


def main():
    x = tf.constant(X, tf.float64)
    y = tf.constant(Y, tf.float64)
    b1 = tf.Variable(500.0, dtype=tf.float64)   # NIST "Start 1"
    b2 = tf.Variable(1e-4, dtype=tf.float64)

    result = tf_gradkit.least_squares(lambda: b1 * (1 - tf.exp(-b2 * x)) - y,
                                      [b1, b2], max_iterations=200)
    estimate = np.array([float(b1), float(b2)])
    lre = -np.log10(np.abs(estimate - CERTIFIED) / np.abs(CERTIFIED))
    print(f"stopped after {int(result.iterations)} iterations: {result.reason}")
    print(f"b1 = {estimate[0]:.10e}  (certified {CERTIFIED[0]:.10e})")
    print(f"b2 = {estimate[1]:.10e}  (certified {CERTIFIED[1]:.10e})")
    print(f"log relative errors: {np.round(lre, 1)}")
    assert bool(result.converged) and lre.min() >= 6


if __name__ == "__main__":
    main()
