"""Two producers feed one ConditionalAccumulator; the slow one's gradient is stale.

Run from the repository root:

    .venv/bin/python examples/conditional_accumulator.py

A chief owns the parameters ``w`` and the accumulator, and updates ``w`` with
the average of ``NUM_REQUIRED = 2`` gradients. Producers read ``w`` together
with the accumulator's global step (the parameter version), compute a gradient
on their own data, and apply it with that step as ``local_step``:

1. Both producers read ``w`` at step 0 and apply in time: the chief averages
   them, updates ``w``, and the global step becomes 1.
2. Both read ``w`` at step 1. The fast one applies; one gradient is not enough,
   so the chief's take is not ready and changes nothing. The fast one computes a
   second gradient (still at step 1) and the chief updates ``w``: step 2.
3. The slow producer finally applies its step-1 gradient. ``w`` has moved on
   since it was read, so the gradient is stale and dropped.

Every accumulator call runs under ``tf.function(jit_compile=True)``.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TF loads: quiet logs

import tensorflow as tf

from tf_gradkit import ConditionalAccumulator

NUM_REQUIRED = 2
LEARNING_RATE = 0.5
DATA = {"fast": tf.constant([4.0, 0.0]), "slow": tf.constant([2.0, -2.0])}


def gradient(w, producer):
    """Gradient of 0.5 * ||w - data||^2 on the producer's own data."""
    return w - DATA[producer]


def main():
    w = tf.Variable([0.0, 0.0])
    acc = ConditionalAccumulator(tf.float32, shape=[2], reduction="MEAN")

    @tf.function(jit_compile=True)
    def apply(grad, local_step):
        return acc.apply_grad(grad, local_step)

    @tf.function(jit_compile=True)
    def chief_step():
        value, ready = acc.take_grad(NUM_REQUIRED)
        w.assign_sub(LEARNING_RATE * value)  # value is zeros when not ready
        return value, ready

    def produce(producer, step_seen, w_seen):
        grad = gradient(w_seen, producer)
        accepted = apply(grad, step_seen)
        print(f"  {producer} producer (read w={w_seen.numpy()} at step "
              f"{int(step_seen)}) applies {grad.numpy()}: "
              f"{'accumulated' if bool(accepted) else 'DROPPED as stale'}")

    def chief():
        value, ready = chief_step()
        if bool(ready):
            print(f"  chief takes the mean {value.numpy()} -> w={w.numpy()}, "
                  f"global step {int(acc.global_step)}")
        else:
            print(f"  chief: only {int(acc.num_accumulated())} of {NUM_REQUIRED} "
                  "gradients, not ready; nothing changes")

    print("1. both producers on time")
    step, w_seen = acc.global_step, w.read_value()
    produce("fast", step, w_seen)
    produce("slow", step, w_seen)
    chief()

    print("2. the slow producer falls behind")
    step, w_seen = acc.global_step, w.read_value()
    slow_step, slow_w = step, w_seen  # the slow producer read w now...
    produce("fast", step, w_seen)
    chief()
    produce("fast", step, w_seen)
    chief()

    print("3. ...and delivers after w was updated")
    produce("slow", slow_step, slow_w)

    print(f"accumulated now: {int(acc.num_accumulated())}, "
          f"dropped as stale: {int(acc.num_dropped())}, "
          f"global step: {int(acc.global_step)}")
    # What the docs say it shows: a take that was not ready changed nothing, the slow
    # gradient was dropped. w by hand: step 1 takes the mean of -[4, 0] and -[2, -2], so
    # w = 0.5 * [3, -1] = [1.5, -0.5]; step 2 the fast producer's [-2.5, -0.5] twice, so
    # w = [1.5, -0.5] + 0.5 * [2.5, 0.5] = [2.75, -0.25] (binary fractions: exact in float32).
    assert (int(acc.num_accumulated()), int(acc.num_dropped()), int(acc.global_step)) == (0, 1, 2)
    assert w.numpy().tolist() == [2.75, -0.25], w.numpy()


if __name__ == "__main__":
    main()
