"""What each print line of the docs shows, checked by `tests/test_docs.py`.

Keyed by (page, the print statement's first line as the page shows it,
comment included): editing the line or its comment means editing its check.
Tolerances say why next to them.
"""

import math
import re

# A number not inside a name ("float32", "dense_1" hold none).
_NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|(?<![\w.])[-+]?(?:nan|inf)\b")


def numbers(text):
    """The numbers in a printed text, in order (thousands separators dropped)."""
    return [float(n) for n in _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", text))]


class Expect:
    """A check of one print line's outputs (one per call)."""

    def check_all(self, outputs, where):
        for out in outputs:
            self.check(out, where)


class Calls(Expect):
    """A print line called several times (in a loop): one check per call."""

    def __init__(self, *expects):
        self.expects = expects

    def check_all(self, outputs, where):
        assert len(outputs) == len(self.expects), f"{where}: printed {len(outputs)} times: {outputs}"
        for out, expect in zip(outputs, self.expects):
            expect.check(out, where)


class Numbers(Expect):
    """Every number printed, in order, is one of ``values`` within ``rtol``
    / ``atol`` (``why`` says why that tolerance)."""

    def __init__(self, *values, rtol=0.0, atol=0.0, why="exact: integers or exact arithmetic"):
        self.values, self.rtol, self.atol, self.why = values, rtol, atol, why

    def check(self, text, where):
        got = numbers(text)
        assert len(got) == len(self.values), f"{where} printed {text!r}: expected numbers {self.values}"
        for g, v in zip(got, self.values):
            assert math.isfinite(g) and abs(g - v) <= self.atol + self.rtol * abs(v), (
                f"{where} printed {text!r}: {g} is not {v} (rtol {self.rtol}, atol {self.atol}: {self.why})")


class Text(Expect):
    """The printed text, exactly."""

    def __init__(self, text):
        self.text = text

    def check(self, text, where):
        assert text == self.text, f"{where} printed {text!r}, the page shows {self.text!r}"


class Check(Expect):
    """``predicate(numbers printed, text printed)`` holds; ``what`` says what
    the page claims."""

    def __init__(self, predicate, what):
        self.predicate, self.what = predicate, what

    def check(self, text, where):
        assert self.predicate(numbers(text), text), f"{where} printed {text!r}: not {self.what}"


class Varies(Expect):
    """Any finite numbers: the page says this output varies (``why``)."""

    def __init__(self, why):
        self.why = why

    def check(self, text, where):
        assert all(math.isfinite(n) for n in numbers(text)), f"{where} printed {text!r}"


def _reasons(text):
    return re.findall(r"(?:cost|step|gradient) tolerance|max_iterations|converged", text)


# float32 round-off in a handful of operations: a few ulps of 1 (1.19e-7).
F32 = dict(rtol=1e-6, atol=1e-6, why="float32 round-off of a few operations")
TOLERANCE_STOP = ("cost tolerance", "step tolerance", "gradient tolerance")

EXPECT = {
    ("README.md", "print(int(opt.iterations))   # 4: 13 micro-batches of at most 16, windows of 4, "
                  "the 13th applied alone"): Numbers(4),
    ("docs/backward_cost.md", "print(cost)   # forward 4,883,839 FLOPs, ... ms; backward 5,540,088 "
                              "FLOPs (1.13x): no dL/dx for the first layer"): Check(
        lambda n, t: n[0] == 4883839 and n[2] == 5540088 and abs(n[3] - 1.13) < 0.005,
        "forward 4,883,839 and backward 5,540,088 FLOPs (1.13x): FLOPs are counted from the "
        "graph, exactly; the times (elided on the page) vary"),
    ("docs/batched_fits.md", "print(fit.x.numpy())          # [B, P]"): Check(
        lambda n, t: len(n) == 6 and all(abs(a - b) < 0.01 for a, b in zip(n, [3, .5, 3, 1, 3, 2])),
        "a [3, 2] array near the true (3, rate) of each fit (the data hold a 0.01 sin term)"),
    ("docs/batched_fits.md", "print(runs[0] == runs[1], kept)   # True ['json', 'mlirbc']: "
                             "the same fits, one module"): Text("True ['json', 'mlirbc']"),
    ("docs/batched_fits.md", "print(fit.converged.numpy(), fit.reason)           # [B] bool, [B] text"):
        Check(lambda n, t: t.startswith("[ True  True  True]") and len(_reasons(t)) == 3,
              "three converged fits, each with its stop reason"),
    ("docs/batched_fits.md", "print(fit.perr.numpy())       # [B, P] standard errors, "
                             "sqrt(diag(covariance))"): Check(
        lambda n, t: len(n) == 6 and all(0 < e < 0.05 for e in n), "a [3, 2] array of small positive errors"),
    ("docs/batched_fits.md", 'print(fit.status.numpy())           # [c 9 c]: fit 1 "no data", '
                             'c in 1-3 (converged)'): Check(
        lambda n, t: len(n) == 3 and n[1] == 9 and n[0] in (1, 2, 3) and n[2] in (1, 2, 3),
        "fit 1 no data (9), the exact fits converged; which tolerance (1-3) is met first "
        "at round-off varies"),
    ("docs/batched_fits.md", "print(fit.undetermined.numpy())     # [ True False  True]: inf "
                             "covariance, warned"): Text("[ True False  True]"),
    ("docs/batched_fits.md", "print(fit.x.dtype.name, np.round(fit.x.numpy(), 3))   # float32, the truth"):
        Check(lambda n, t: t.startswith("float32") and len(n) == 10 and all(
            abs(a - b) <= 2e-3 * max(1.0, abs(b)) for a, b in zip(
                n, [80.0, 2.1, 1.9, 1.3, 5.0, 60.0, 2.4, 2.2, 1.6, 3.0])),
              "float32 parameters at the truth (noise-free data; printed to 3 decimals, and "
              "float32 round-off of the fit, ~1e-4 relative, allowed up to 2e-3)"),
    ("docs/conditional_accumulator.md", "print(value.numpy())        # [1. 2.]: the mean of the three"):
        Numbers(1, 2),
    ("docs/conditional_accumulator.md", "print(bool(acc.apply_grad([1.0, 2.0], local_step=step_seen)))"
                                        "     # A, on time: True"): Text("True"),
    ("docs/conditional_accumulator.md", "print(value.numpy(), bool(ready))                          "
                                        "       # [1. 2.] True"): Text("[1. 2.] True"),
    ("docs/conditional_accumulator.md", "print(int(acc.global_step))                                "
                                        "       # 1: parameters moved on"): Numbers(1),
    ("docs/conditional_accumulator.md", "print(bool(acc.apply_grad([9.0, 9.0], local_step=step_seen)))"
                                        "     # B, stale: False"): Text("False"),
    ("docs/conditional_accumulator.md", "print(int(acc.num_accumulated()), int(acc.num_dropped()))  "
                                        "       # 0 1"): Numbers(0, 1),
    ("docs/conditional_accumulator.md", "print(bool(chief_step(w)), w.numpy())   # False [1. 1.]: "
                                        "nothing accumulated yet"): Text("False [1. 1.]"),
    ("docs/constraints.md", "print(model.layers[0].kernel.numpy().sum(axis=0))   # each column sums to 1"):
        Numbers(1, 1, 1, 1, **F32),
    ("docs/constraints.md", "print(np.abs(q.numpy().T @ q.numpy() - np.eye(16)).max())          # ~1e-7"):
        Check(lambda n, t: 0 <= n[0] < 1e-6, "float32 round-off (~1e-7; below 1e-6)"),
    ("docs/constraints.md", "print(np.abs(w.T @ w - np.eye(4)).max())                           # ~1e-7"):
        Check(lambda n, t: 0 <= n[0] < 1e-6, "float32 round-off (~1e-7; below 1e-6)"),
    ("docs/constraints.md", "print(np.linalg.eigvalsh(model.layers[2].kernel.numpy()).min() >= -1e-5)"
                            "   # True"): Text("True"),
    ("docs/constraints.md", "print(np.diff(model.layers[3].kernel.numpy()[:, 0]))               "
                            "# all >= 0"): Check(lambda n, t: len(n) == 3 and min(n) >= 0, "all >= 0"),
    ("docs/constraints.md", 'print(model.get_layer("hidden").kernel.numpy().min())                  '
                            "      # >= 0"): Check(lambda n, t: n[0] >= 0, ">= 0"),
    ("docs/constraints.md", 'print(np.linalg.norm(model.get_layer("head").kernel.numpy(), axis=0))  '
                            "     # all 1"): Numbers(1, 1, 1, 1, **F32),
    ("docs/gpu_and_xla.md", 'print("loop kernel:", spd.uses_loop(a.shape[0]))   # at trace time'):
        Check(lambda n, t: t in ("loop kernel: True", "loop kernel: False"), "printed once, when traced"),
    ("docs/gradient_accumulation.md", "print(accumulator_dtype, kernel)  # 33.0 both times (33.125 "
                                      "rounded to bfloat16)"): Calls(
        Numbers(33), Numbers(33, why="exact: 33.125 is 33.0 in bfloat16's 8-bit significand")),
    ("docs/gradient_accumulation.md", "print(int(opt.iterations.numpy()), int(opt.micro_steps.numpy()))"
                                      "   # 32 126"): Numbers(32, 126),
    ("docs/gradients.md", "print(jacobian(lambda: tf.stack([x[0] * x[1], x[0] ** 2]), x).numpy())   "
                          "# [[2, 1], [2, 0]]"): Numbers(2, 1, 2, 0),
    ("docs/gradients.md", "print(jac.shape)                                            # (1, 2, 1, 4)"):
        Text("(1, 2, 1, 4)"),
    ("docs/gradients.md", 'print(np.allclose(jac[0, :, 0, :], tf.transpose(model.get_layer("h2").kernel)))'
                          "  # True"): Text("True"),
    ("docs/gradients.md", "print(seen[0].shape)       # (2, 4): dL/d(hidden output), before it was halved"):
        Text("(2, 4)"),
    ("docs/gradients_per_example.md", "print(grads[0][:, :, 0].numpy().tolist())      # [[1.0, 0.0], "
                                      "[0.0, 3.0]]: each example's x_i"): Text("[[1.0, 0.0], [0.0, 3.0]]"),
    ("docs/gradients_per_example.md", "print(norms.shape, len(by_variable))                        "
                                      "  # (16,) 6"): Text("(16,) 6"),
    ("docs/gradients_per_example.md", "print(float(tf.reduce_max(tf.abs(norms - direct) / "
                                      "(direct + atol))))  # ~1e-7"): Check(lambda n, t: 0 <= n[0] < 1e-6,
                                                          "float32 round-off (~1e-7; below 1e-6)"),
    # NIST's certified values; "about 10 digits": LRE >= 9.5, a relative error below 10**-9.5.
    ("docs/levenberg_marquardt.md", "print(float(b1), float(b2), result.reason)  # NIST Misra1a: "
                                    "238.94212918, 0.00055015643181 to about 10 digits (LRE 9.99, 9.88)"):
        Check(lambda n, t: abs(n[0] / 2.3894212918e2 - 1) < 10 ** -9.5
              and abs(n[1] / 5.5015643181e-4 - 1) < 10 ** -9.5 and t.endswith(TOLERANCE_STOP),
              "Misra1a's certified b1, b2 to about 10 digits (LRE >= 9.5)"),
    ("docs/levenberg_marquardt.md", "print(np.abs(model(test).numpy() - np.sin(np.pi * test)).max())"
                                    "   # ~2e-6"): Check(
        lambda n, t: 0 <= n[0] < 1e-5, "~2e-6 (a float32 network: below 1e-5)"),
    ("docs/levenberg_marquardt.md", "print(p.numpy(), result.reason)                          "
                                    "# [2.97 0.45 0.6 ], cost tolerance"): Check(
        lambda n, t: all(abs(a - b) <= 0.005 for a, b in zip(n, [2.97, 0.45, 0.6]))
        and t.endswith("cost tolerance"), "[2.97 0.45 0.6] to the 2 digits shown, cost tolerance"),
    ("docs/levenberg_marquardt.md", "print(result.active_mask.numpy())                        "
                                    "# [ 0  0 -1]: c on its lower bound"): Numbers(0, 0, -1),
    ("docs/levenberg_marquardt.md", "print(np.sqrt(np.diag(result.covariance.numpy())))      "
                                    "# standard errors, as curve_fit's"): Check(
        lambda n, t: len(n) == 3 and all(0 < e < 1 for e in n), "three positive standard errors"),
    ("docs/levenberg_marquardt.md", "print(float(rate), result.reason)      # 0.4"): Check(
        lambda n, t: abs(n[0] - 0.4) < 1e-9 and t.endswith(TOLERANCE_STOP),
        "0.4: exact data, so the fit recovers it to float64 solve accuracy (1e-9)"),
    ("docs/levenberg_marquardt.md", "print(tape.gradient(rate, y).numpy())  # how the fitted rate "
                                    "moves with each data point"): Check(
        lambda n, t: len(n) == 20 and all(math.isfinite(v) for v in n), "one finite derivative per point"),
    ("docs/levenberg_marquardt.md", "print(result.reason, 2 * float(result.cost))  # converged, sum of "
                                    "squares ~1e-30"): Check(
        lambda n, t: t.startswith(TOLERANCE_STOP) and 0 <= n[-1] < 1e-25,
        "a tolerance stop (converged) with a sum of squares at float64 round-off (~1e-30; below 1e-25)"),
    ("docs/levenberg_marquardt.md", "print(opt.solver_used)  # dual"): Text("dual"),
    ("docs/levenberg_marquardt.md", "print(p.numpy())                          # [2. 0.5 0.5], then "
                                    "[2. 1. 0.5], [2. 1.5 0.5]"): Calls(
        *(Numbers(2, rate, 0.5, rtol=1e-6, why="exact data: float64 fit to its tolerances")
          for rate in (0.5, 1.0, 1.5))),
    ("docs/levenberg_marquardt.md", "print(SOLVES.info().misses, SOLVES.info().hits)   # 1 2: one "
                                    "trace, then runs only"): Numbers(1, 2),
    ("docs/precise_bn.md", "print(counts)                                                     "
                           "# elements per feature: 200"): Numbers(200),
    ("docs/precise_bn.md", "print(np.allclose(model.layers[1].moving_mean, np.mean(bn_inputs, 0), "
                           "atol=1e-5))   # True"): Text("True"),
    ("docs/pruning.md", 'print("pruned entries non-zero:", int(np.count_nonzero(kernel[mask == 0])))'
                        "   # 0"): Numbers(0),
    ("docs/pruning.md", 'print("columns kept:", int(kept.sum()), "of 10; their norms - 1:",'): Check(
        lambda n, t: 1 <= n[0] <= 10 and n[1] == 10 and 0 <= n[-1] < 1e-6,
        "unit norm to float32 round-off (below 1e-6) in every column kept"),
    ("docs/pruning.md", 'print("LM cost", float(cost), "unpruned parameters:", unpruned, "of",'): Check(
        lambda n, t: n[1] == 31 and n[2] == 103, "31 of 103: 20% of 60 and of 30 kernel entries, and 13 biases"),
    ("docs/pruning.md", 'print("pruned entries non-zero after LM:",'): Numbers(0),
    ("docs/pruning_keras3.md", "print(int(opt.iterations), opt.inner_optimizer.sparsity())   # 48 "
                               "updates; 80% of each kernel"): Check(
        lambda n, t: n[0] == 48 and len(n) == 3 and all(abs(v - 0.8) <= 1 / 64 for v in n[1:]),
        "48 updates; each kernel 80% sparse (to one entry of the 64-entry kernel: 1/64)"),
    ("docs/update_monitor.md", "print(len(monitor.history))    # 4: one per real update (16 "
                               "micro-batches, windows of 4)"): Numbers(4),
    ("docs/weighted_aggregation.md", "print([t.numpy() for t in mean])   # [1.75, 0.75], 0.75"):
        Numbers(1.75, 0.75, 0.75, **F32),
    ("docs/weighted_aggregation.md", "print(server[0].numpy()[0, 0])   # (50 * 1 + 10 * 4) / 60 = 1.5"):
        Numbers(1.5, **F32),
    ("docs/accum_batchnorm.md", "print(bn.moving_mean.numpy()[:4], bn.moving_variance.numpy()[:4])"
                                "   # about [0.45 ...] [1.45 ...]"): Check(
        lambda n, t: len(n) == 8 and all(abs(m - 0.446) < 0.06 for m in n[:4])
        and all(abs(v - 1.447) < 0.2 for v in n[4:]),
        "16 updates: mean 3 (1 - 0.99**16) = 0.446, variance 0.99**16 + 4 (1 - 0.99**16) = 1.447, "
        "within the data's sampling noise (each window's mean of 32 draws of std 2: 0.35, averaged "
        "over 16 windows by the moving average); 64 updates would be 1.42 and 2.42"),
    ("docs/constraints.md", "print(w.numpy(), w.numpy().sum())   # [[0. 0. 1.]] 1.0"):
        Numbers(0, 0, 1, 1, **F32),
    ("docs/distributed.md", "print(bool(ready), value.numpy(), int(acc.global_step))   # True [1. 1.] 1"):
        Text("True [1. 1.] 1"),
    ("docs/gpu_and_xla.md", 'print("max error, split products:", np.max(np.abs(split - exact)))   '
                            "# ~6e-4: float32's"): Check(
        lambda n, t: 0 <= n[0] < 2e-3, "float32's error on sums of 1000 products of order 1000 "
        "(~6e-4; below 2e-3)"),
    ("docs/gpu_and_xla.md", 'print("max error, TF32 products: ", np.max(np.abs(tf32 - exact)))    '
                            "# ~6e-2: 100 times more"): Check(
        lambda n, t: 0.02 < n[0] < 0.2, "TF32's 10-bit mantissa: ~6e-2, 30 to 300 times float32's"),
    # No comment on the page: the fit recovers the data's own a = 2, b = 1.5 (exact data, float32).
    ("docs/levenberg_marquardt.md", "print(float(a), float(b), float(cost))"): Check(
        lambda n, t: abs(n[0] - 2) < 1e-4 and abs(n[1] - 1.5) < 1e-4 and 0 <= n[2] < 1e-8,
        "a = 2, b = 1.5 to float32 accuracy (1e-4), cost near 0"),
    # The sinc fit: the page shows the history's keys; the fit is good (y's variance is ~0.05).
    ("docs/levenberg_marquardt.md", 'print(history.history["loss"][-1], history.history["damping"][-1], '
                                    'history.history["attempts"][-1])'): Check(
        lambda n, t: 0 <= n[0] < 0.01 and n[1] > 0 and n[2] >= 1,
        "a fitted sinc (MSE below 0.01), a positive damping, at least one attempt"),
}
