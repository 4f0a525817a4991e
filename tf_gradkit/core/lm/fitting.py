"""Many small fits in one call: `least_squares_batched` and `curve_fit`.

B independent problems (a 2-D Gaussian to every spot of a movie, a decay to
every pixel) are solved together by `batched.solve`: one compiled XLA loop
per chunk of ``batch_size`` problems, each problem with its own damping,
stop reason and ``converged`` flag, each ending where `least_squares` ends
on it alone with the same options. A problem with non-finite data or an
infeasible start gets its own status; the others are not touched.

The compiled chunk solve is kept (by the residual function, the options and
the chunk's shapes and dtypes), so a repeated call with the same function
only runs.
"""

import functools
import os
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_gradkit.core.lm import batched
from tf_gradkit.core.lm import batched_parts
from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import fit_report
from tf_gradkit.core.lm import fixed as fixed_lib
from tf_gradkit.core.lm import in_flight
from tf_gradkit.core.lm import loop_data
from tf_gradkit.core.lm import module_store
from tf_gradkit.core.lm import poisson
from tf_gradkit.core.lm import small
from tf_gradkit.core.lm import solve_cache
from tf_gradkit.core.lm import whole_solve
from tf_gradkit.core.lm.parts import resolve_part
from tf_gradkit.core.lm.robust import RobustLoss

# Jacobian elements (chunk x N x P) per chunk when `batch_size` is None: on a
# GPU 2**24 (64 MB in float32; with the solver's copies a chunk needs a few
# times that, so 10^6 fits of 225 points run in a few GB); on CPUs 4 MB of
# Jacobian (2**20 float32 or 2**19 float64 elements), each of the P columns
# ~840 KB, which keeps a chunk's passes in cache (measured faster per fit
# than larger chunks: on the float64 bounded decay, 100 points, 1,048 fits
# per chunk ran 18k fits per CPU-second, the 2,097 of a 2**20-element
# budget 12-15k; docs/batched_fits.md).
CHUNK_ELEMENTS = 2 ** 24
CHUNK_BYTES_CPU = 2 ** 22
# Compiled (XLA) on CPUs, chunks of half that, 2 MB of Jacobian, where a
# core's L2 cache holds 2 MB (read from Linux's sysfs; `_core_l2_bytes`):
# each column of the 2-D Gaussian 15x15 or of benchmarks/bounded_decay.py's
# decay (100 points, float64) is then ~420 KB, and each of the two threads
# keeps its half of a chunk's arrays in its own L2. Measured on the 2-core
# Intel Xeon (2 MB of L2 a core), in-process A/B of whole calls of 10^5
# fits, medians of three, fits per CPU-second: 15x15 Cpufit's stopping
# rule 74k at 466 fits a chunk against 58k at 932 (one thread 76k against
# 56k), the defaults 61k against 48k; the decay 33k at 512 against 24k at
# 1,048 (and 31k at 640, 28k at 768, 19k at 2,096) (2026-12-01 morning);
# Gpufit's 5x5 with Cpufit's stopping rule 427-430k at 4,096 against
# 390-395k at 8,388, the defaults 361-363k against 329k (2026-12-01
# afternoon, two runs). Not for the plain engine (10^4 15x15 fits: 0.79 s
# of CPU at 466 a chunk against 0.74 s at 932). Not on a CPU with less L2:
# on the AMD EPYC machine (an AVX-512 EPYC, so 1 MB of L2 a core by AMD's
# specification; not read there) the decay in chunks of 524 fits ran
# 0.68-0.89x the fits per CPU-second of 1,048 (2026-11-29) and the 5x5 in
# chunks of 4,096 190k against 205k at 8,388 (2026-12-01): there the
# smaller chunk's arrays do not fit L2 either, and its kernels cost more
# overhead per fit.
CHUNK_BYTES_CPU_COMPILED = 2 ** 21

# jit_compile="auto" (the default): a plain ``tf.function`` until this
# function, with these options, has been given this many fits in this
# process (this call's included), XLA from then on. Why: XLA's compile of a
# chunk solve costs 7-10 s of CPU in a new process, the plain function's
# first call about 2 s, and XLA then runs each fit 3-10x faster (on Gpufit's
# Gaussians, 2 against 21 us per 5x5 fit, 21 against 70 us per 15x15 fit,
# 2026-11-28, docs/batched_fits.md). So 10^4 fits take 2-3 s instead of
# 9-11 s, while a call of 10^5 fits, or the 66th call of 10^3, compiles
# and runs at XLA's speed. The two engines round differently: pass
# ``jit_compile=True`` or ``False`` for one of them throughout.
AUTO_XLA_FITS = 2 ** 16
# Fits given so far per function and options under "auto": an LRU of
# `solve_cache.SOLVES`'s size (the functions it keeps alive are bounded as
# that cache's are).
_AUTO_FITS = solve_cache.SolveCache(maxsize=solve_cache.SOLVES.maxsize)
# A compiled chunk has the compacted tail (`batched.COMPACT_FRACTION`) only
# in a call of at least this many fits, or when "auto" moved to XLA (its
# count of fits is past `AUTO_XLA_FITS` then). The tail is a second loop,
# about a third of the program: a first call of 10^4 of Gpufit's 5x5
# Gaussians compiled in 9.6 s of CPU without it against 14.5 s with it, and
# a second process read the XLA cache in 0.42 s against 0.51 s (medians of
# five; 2026-11-29, docs/batched_fits.md), while it saves about 3 ms of a
# 8,388-fit chunk's run (on the decay of benchmarks/bounded_decay.py about
# 15 ms of 1,048 fits'): it pays for itself over many chunks, not in a call
# of a few. Each fit's steps are the same with or without it (to
# round-off: tests/test_small_fits.py). So from `batched.COMPACT_MIN_BATCH`
# fits a chunk, "auto"'s XLA and a smaller call by name run two programs.
TAIL_MIN_FITS = AUTO_XLA_FITS


class BatchedFitResult(NamedTuple):
    """What `least_squares_batched` and `curve_fit` return (tensors).

    Attributes:
      x: ``[B, P]`` the solutions (``[P]`` for one `curve_fit` fit, and so
        on for the others).
      cost: ``[B]`` final ``0.5 * sum rho(r^2)``.
      converged: ``[B]`` bool: a tolerance met at a stationary point (as
        `least_squares`).
      status: ``[B]`` int64, an index into `BATCHED_REASONS` (`reason`
        gives the text): 1-3 converged, 4 iteration limit, 5 no acceptable
        step, 6 a step or cost tolerance met away from a stationary point,
        7 non-finite start (the parameters, data or residuals), 8
        infeasible start, 9 no data (every point masked).
      stopped_by: ``[B]`` int64: for status 6 the code of the test that
        stopped the fit (1 gtol, 2 xtol, 3 ftol), else 0 (`reason` names it).
      iterations: ``[B]`` LM iterations run (both phases of "hybrid").
      covariance: ``[B, P, P]`` the parameters' covariance (`curve_fit`'s
        ``pcov``; with ``absolute_sigma=False`` scaled by ``2 cost / (n - P)``,
        ``n`` the problem's unmasked points; ``inf`` when ``n <= P``).
      perr: ``[B, P]`` standard errors, ``sqrt(diag(covariance))``.
      optimality, stationarity, damping, grad, active_mask: as
        `LeastSquaresResult`, per problem.
      fun, jac: the residuals ``[B, N]`` and the Jacobian ``[B, N, P]`` at
        the solution, with ``full_output=True`` (else None).
      undetermined: ``[B]`` bool: the covariance could not be estimated
        (the Jacobian is rank-deficient at the solution, e.g. the model
        ignores a parameter, or ``n <= P``): ``covariance`` is ``inf`` there
        (scipy's convention; `curve_fit` also warns, `fit_report`).
    """

    x: tf.Tensor
    cost: tf.Tensor
    converged: tf.Tensor
    status: tf.Tensor
    iterations: tf.Tensor
    covariance: tf.Tensor
    perr: tf.Tensor
    optimality: tf.Tensor
    stationarity: tf.Tensor
    damping: tf.Tensor
    grad: tf.Tensor
    active_mask: tf.Tensor
    fun: tf.Tensor = None
    jac: tf.Tensor = None
    undetermined: tf.Tensor = None
    stopped_by: tf.Tensor = None

    @property
    def reason(self):
        """Why each problem stopped, as text (a numpy array of strings); a
        stall names the tolerance that stopped it (`stopped_by`)."""
        return whole_solve.reason_text(
            batched.BATCHED_REASONS, self.status,
            0 if self.stopped_by is None else self.stopped_by)


BATCHED_REASONS = batched.BATCHED_REASONS


def least_squares_batched(fun, x0, args=(), *, mask=None, bounds=None,
                          loss="linear", f_scale=1.0, x_scale=None,
                          max_iterations=100, controller="trust_region",
                          scaling=None, solver="auto", max_attempts=10, gtol=None,
                          xtol=None, ftol=None, batch_size=None,
                          full_output=False, jit_compile="auto", jac=None,
                          parameters_to_fit=None, progress=False):
    """Solves B independent nonlinear least-squares problems at once.

    Each problem ``b`` minimises ``0.5 * sum_i rho(fun(x, *args)[b, i]^2)``
    over its own row ``x[b]``, exactly as `least_squares` would alone with the
    same options (same iterations, stop reasons and solution, to round-off).

    Args:
      fun: ``fun(x, *args) -> [B, N]`` residuals from parameters ``x``
        ``[B, P]`` (TensorFlow ops; row ``b`` may depend on ``x[b]`` and the
        rows ``b`` of ``args`` only).
      x0: ``[B, P]`` starts (float32 or float64; other inputs are cast).
      args: a tuple of arrays with a leading batch axis ``B``, the
        problems' data (chunked with them). Shared data: close over it.
      mask: optional ``[B, N]`` bool, False where a residual is padding
        (ragged problems): it is 0 whatever ``fun`` gives there and does not
        count as a point.
      bounds: ``(lower, upper)``, each a scalar, ``[P]`` (all problems) or
        ``[B, P]`` (per problem); ``-inf``/``inf`` for none. A start outside
        its box gives that problem status 8 (infeasible).
      loss, f_scale, x_scale, max_iterations, controller, scaling, solver,
        max_attempts, gtol, xtol, ftol: as `least_squares` (``solver`` "auto",
        "qr" or "cholesky"; "auto", the default, is "cholesky" up to 10
        parameters, else "qr", as `least_squares` resolves it;
        ``controller`` a name or a damping object).
      batch_size: problems per compiled chunk (memory); default: at most
        ``2**24 / (N * P)`` with a GPU, ``2**22 / (N * P * itemsize)``
        without (``2**20 / (N * P)`` in float32); a smaller call is one
        chunk of its size (`curve_fit` pads it by at most 1/8, to one of a
        few sizes per power of two), and a call of a few more fits than a
        chunk runs as equal smaller chunks where they save over 1/8 of the
        work (`_chunk_size`).
      full_output: also return ``fun`` and ``jac`` at the solutions.
      jit_compile: True: compile each chunk's solve with XLA (in a call of
        fewer than `TAIL_MIN_FITS` fits without the compacted tail, a third
        of the program, which pays for itself only over many chunks);
        False: a plain ``tf.function``; "auto" (default): plain until this
        function with these options has been given `AUTO_XLA_FITS` (65,536)
        fits in this process, this call's included, then XLA (a first call of 10^4
        small fits takes about 2 s instead of XLA's 9-11 s of compile; the
        two round differently). A function XLA cannot compile (e.g. it
        calls ``tf.numpy_function``) stays plain, with a warning.
      jac: optional ``jac(x, *args) -> [B, N, P]``, the residuals' Jacobian
        (TensorFlow ops), used instead of forward-mode differentiation
        (scipy's callable ``jac``); masked rows are zeroed here.
      parameters_to_fit: optional ``[P]`` of 1 (fit) and 0 (fixed), or
        bools (Gpufit's ``parameters_to_fit``): a fixed parameter keeps its
        start ``x0[b, j]`` in every fit and the solve runs on the free ones
        (the reduced problem). Its covariance row and column, ``perr``,
        ``grad`` and Jacobian column are 0 (Gpufit's convention); its
        bounds are not used.
      progress: print a text progress bar across the chunks (at most
        ``batch_size`` problems each) as they finish.

    Returns:
      A `BatchedFitResult`.

    Raises:
      ValueError: a shape or an option that does not fit, naming it, before
        anything runs.
    """
    _check_eager("least_squares_batched")
    x0, dtype = _parameters(x0, "x0")
    batch = int(x0.shape[0])
    if not isinstance(args, (tuple, list)):
        raise ValueError("least_squares_batched: `args` must be a tuple of arrays "
                         f"with a leading batch axis. Received: {type(args).__name__}")
    per_fit = tuple(_batched(a, dtype if _is_float(a) else None, batch, f"args[{i}]")
                    for i, a in enumerate(args))
    if mask is not None:
        mask = _mask(mask, batch, None, "mask")
    return _solve("fun", (fun, jac), x0, per_fit, (), mask, bounds,
                  dict(loss=loss, f_scale=f_scale, x_scale=x_scale,
                       max_iterations=max_iterations, controller=controller,
                       scaling=scaling, solver=solver, max_attempts=max_attempts,
                       gtol=gtol, xtol=xtol, ftol=ftol),
                  batch_size, full_output, jit_compile, absolute=False,
                  name="least_squares_batched", parameters_to_fit=parameters_to_fit,
                  progress=progress)


def curve_fit(f, xdata, ydata, p0, sigma=None, bounds=(-np.inf, np.inf),
              loss="linear", f_scale=1.0, *, absolute_sigma=None, mask=None,
              xdata_per_fit=None, x_scale=None, max_iterations=100,
              batch_size=None, full_output=False, dtype=None, estimator="lse",
              parameters_to_fit=None, progress=False, **options):
    """Fits ``ydata ~ f(xdata, params)`` for B data sets at once.

    The batched ``scipy.optimize.curve_fit``: residuals ``(f(xdata, p) -
    ydata) / sigma`` per data set, solved by `least_squares_batched`.

    Args:
      f: ``f(xdata, params) -> [B, N]`` with ``params`` ``[B, P]``
        (TensorFlow ops, so one call computes every fit's model).
      xdata: the independent variable: shared by all fits (any shape, e.g.
        ``[N]`` or ``[2, N]``) or one per fit with a leading axis ``B``;
        ``xdata_per_fit`` says which (default: per fit when its leading axis
        is ``B`` and it has at least 2 dimensions).
      ydata: ``[B, N]``, or ``[N]`` for one fit (then ``p0`` is ``[P]`` and
        the result has no batch axis).
      p0: ``[B, P]`` starts (``[P]`` for one fit).
      sigma: None, a scalar, ``[N]`` (all fits) or ``[B, N]``: each point's standard
        deviation (1-D ``sigma`` of scipy's ``curve_fit``; a full covariance
        matrix is not accepted). ``inf`` drops a point like ``mask``.
      bounds, loss, f_scale: as scipy's ``curve_fit``/``least_squares``;
        ``bounds`` sides scalar, ``[P]`` or ``[B, P]``.
      absolute_sigma: as scipy: the covariance is not rescaled by the
        reduced chi-square (default False; with ``estimator="mle"`` always
        True: a Poisson count's variance is its mean, nothing to rescale).
      mask: optional ``[B, N]`` bool, False at padding (ragged data).
      xdata_per_fit: True/False to say whether ``xdata`` has a batch axis.
      x_scale, max_iterations, batch_size, full_output, parameters_to_fit,
        progress: as `least_squares_batched` (``parameters_to_fit`` ``[P]``,
        the fixed parameters keep their ``p0``).
      estimator: "lse" (least squares, the default) or "mle" (Gpufit's
        names): "mle" is Poisson maximum likelihood for counts, minimising
        the deviance ``2 * sum(f - y - y log(f / y))`` (``2 * cost``, Gpufit's
        chi-square); ``ydata`` must be >= 0, ``sigma`` and a robust ``loss``
        are refused, a model value <= 0 at the start gives that fit status
        7 (non-finite start) and a step to one is rejected.
      dtype: the solve's dtype (default: numpy's promotion of the float
        arrays among ``p0`` and ``ydata``, lists and ints not counting:
        float32 data with a list ``p0`` solve in float32; float64 when
        neither is a float array).
      **options: `least_squares_batched`'s other options (``solver``,
        ``controller``, ``scaling``, ``gtol``, ``xtol``, ``ftol``,
        ``max_attempts``, ``jit_compile``, and ``jac``: ``jac(xdata,
        params) -> [B, N, P]``, the model's Jacobian in TensorFlow ops,
        used instead of forward-mode differentiation; divided by ``sigma``
        and masked here).

    Returns:
      A `BatchedFitResult`: ``x`` ``[B, P]``, ``cost``, ``converged``,
      ``status``, ``covariance`` ``[B, P, P]``, ``perr``...

    Example:

    >>> t = np.linspace(0.0, 4.0, 40)
    >>> rates = np.array([0.5, 1.0, 2.0])
    >>> y = 3.0 * np.exp(-rates[:, None] * t)
    >>> fit = tf_gradkit.curve_fit(
    ...     lambda t, p: p[:, :1] * tf.exp(-p[:, 1:] * t), t, y, np.ones([3, 2]))
    >>> np.round(fit.x.numpy(), 6).tolist()
    [[3.0, 0.5], [3.0, 1.0], [3.0, 2.0]]
    """
    unknown = set(options) - {"solver", "controller", "scaling", "gtol", "xtol",
                              "ftol", "max_attempts", "jit_compile", "jac"}
    if unknown:
        raise TypeError(f"curve_fit: unexpected keyword arguments {sorted(unknown)}.")
    _check_eager("curve_fit")
    jit_compile = options.pop("jit_compile", "auto")
    jac = options.pop("jac", None)
    _check_curve_inputs(xdata, ydata, p0)
    absolute_sigma = _estimator(estimator, ydata, sigma, loss, absolute_sigma)
    one = np.ndim(ydata) == 1
    if one:
        if np.ndim(p0) != 1:
            raise ValueError("curve_fit: with one data set (`ydata` [N]) `p0` must be "
                             f"[P]. Received: p0 of shape {np.shape(p0)}")
        ydata, p0 = np.asarray(ydata)[None], np.asarray(p0)[None]
        sigma = (sigma if sigma is None or np.ndim(sigma) == 0
                 else np.asarray(sigma)[None])
        mask = None if mask is None else np.asarray(mask)[None]
        if xdata_per_fit:
            xdata = tf.nest.map_structure(lambda a: np.asarray(a)[None], xdata)
        bounds = _single_bounds(bounds)
    if dtype is None:
        dtype = _data_dtype(p0, ydata)
    p0, dtype = _parameters(p0, "p0", dtype)
    batch = int(p0.shape[0])
    ydata = _batched(ydata, dtype, batch, "ydata", rank=2)
    n = int(ydata.shape[1])
    leaves = tf.nest.flatten(xdata)
    if xdata_per_fit is None:
        xdata_per_fit = all(np.ndim(a) >= 2 and np.shape(a)[0] == batch
                            for a in leaves)
    if xdata_per_fit:
        xdata = tf.nest.map_structure(
            lambda a: _batched(a, dtype if _is_float(a) else None, batch, "xdata"),
            xdata)
    else:
        xdata = tf.nest.map_structure(
            lambda a: tf.cast(a, dtype) if _is_float(a) else tf.convert_to_tensor(a),
            xdata)
    # No sigma and no mask (nor an infinite sigma) stay None: the residuals
    # are then ``f - ydata`` with no array of ones to divide by and none of
    # True to select with, each read once per point for the residuals and
    # every Jacobian column (Gpufit's 5x5 Gaussian: 12-18% more fits per
    # CPU-second under XLA). Dividing by 1 and selecting everywhere changed
    # nothing: the same residuals to the bit.
    if sigma is not None:
        s = np.shape(sigma)
        if s == ():  # one sigma for every point (as scipy)
            sigma, s = np.full([n], sigma, np.float64), (n,)
        if s not in ((n,), (batch, n)):
            raise ValueError(
                f"curve_fit: `sigma` must be [N] or [B, N] ([{n}] or [{batch}, "
                f"{n}]), one standard deviation per point. Received: shape {s}")
        sigma = tf.broadcast_to(tf.cast(sigma, dtype), [batch, n])
    if mask is not None:
        mask = _mask(mask, batch, n, "mask")
    if sigma is not None and np.any(np.isinf(sigma)):   # an inf sigma drops its point
        finite = ~tf.math.is_inf(sigma)
        mask = finite if mask is None else mask & finite
    per_fit = (xdata, ydata, sigma) if xdata_per_fit else ((), ydata, sigma)
    shared = () if xdata_per_fit else (xdata,)
    result = _solve("curve" if estimator == "lse" else "curve_mle", (f, jac), p0,
                    per_fit, shared, mask, bounds,
                    dict(loss=loss, f_scale=f_scale, x_scale=x_scale,
                         max_iterations=max_iterations, **options),
                    batch_size, full_output, jit_compile, absolute=absolute_sigma,
                    name="curve_fit", parameters_to_fit=parameters_to_fit,
                    progress=progress, pad_small=True)
    if one:
        result = BatchedFitResult(*[None if t is None else t[0] for t in result])
    if tf.executing_eagerly():
        fit_report.warn_undetermined(result.undetermined, "curve_fit")
    return result


def _estimator(estimator, ydata, sigma, loss, absolute_sigma):
    """Refuses what the estimator cannot take, naming it; returns the
    effective ``absolute_sigma``."""
    if estimator not in ("lse", "mle"):
        raise ValueError("curve_fit: `estimator` must be 'lse' (least squares) or "
                         "'mle' (Poisson maximum likelihood, Gpufit's names). "
                         f"Received: estimator={estimator!r}")
    if estimator == "lse":
        return bool(absolute_sigma)
    if sigma is not None:
        raise ValueError("curve_fit: estimator='mle' takes no `sigma` (a Poisson "
                         "count's variance is the model value itself; Gpufit "
                         "ignores weights with MLE). Received: sigma given; "
                         "drop it, or use estimator='lse' for weighted least squares.")
    if loss != "linear":
        raise ValueError("curve_fit: estimator='mle' takes no robust `loss` (the "
                         f"deviance is the objective). Received: loss={loss!r}")
    if absolute_sigma is False:
        raise ValueError("curve_fit: estimator='mle' reports the unscaled "
                         "covariance (absolute_sigma=True): the Poisson variance is "
                         "known. Received: absolute_sigma=False; leave it out.")
    y = np.asarray(ydata, dtype=np.float64)
    if np.any(y < 0):
        raise ValueError("curve_fit: estimator='mle' fits counts: `ydata` must be "
                         f">= 0. Received: a minimum of {np.nanmin(y)!r}; use "
                         "estimator='lse' for signed data.")
    return True


def _check_curve_inputs(xdata, ydata, p0):
    """Refuses, naming the argument, what `curve_fit` cannot fit (before
    anything reaches TensorFlow)."""
    if xdata is None:
        raise ValueError(
            "curve_fit: `xdata` is None; pass the independent variable (any "
            "array `f(xdata, params)` reads, e.g. np.arange(N) when `f` needs "
            "none).")
    if p0 is None:
        raise ValueError(
            "curve_fit: `p0` is None; pass the starts, [P] for one fit or [B, P] "
            "(`f(xdata, params)` takes all parameters as one array, so their "
            "number cannot be read from its signature as scipy does).")
    if ydata is None or np.ndim(ydata) == 0:
        raise ValueError(
            "curve_fit: `ydata` must be [N] for one fit or [B, N] for B fits "
            f"(one value per point). Received: ydata={ydata!r}")
    if np.shape(ydata)[-1] == 0:
        raise ValueError(
            "curve_fit: `ydata` has no points (shape "
            f"{tuple(np.shape(ydata))}): there is nothing to fit (as scipy, "
            "which refuses empty data). Pass at least one point per fit.")


def _with_jacobian(residual_fn, jac_fn, name):
    """``residual_fn`` given the ``jacobian`` ability (`batched_parts.jacobian`
    reads it) from the user's ``jac``, its shape checked at trace time."""
    if jac_fn is None:
        return residual_fn

    def jacobian(x):
        j = jac_fn(x)
        want = [x.shape[0], None, x.shape[1]]
        if j.shape.rank != 3 or j.shape[0] != want[0] or j.shape[2] != want[2]:
            raise ValueError(f"{name}: `jac` must return [B, N, P] ([{want[0]}, N, "
                             f"{want[2]}]), the Jacobian of the residuals. Received: "
                             f"shape {j.shape}")
        return tf.cast(j, x.dtype)

    residual_fn.jacobian = jacobian
    return residual_fn


# What a model's error says of chunks: per-fit data that `f` closes over
# instead of taking through `xdata` does not follow the chunks.
CHUNKS_TEXT = ("fits run in chunks, padded: per-fit data must come through "
               "`xdata` (with a leading axis B, `xdata_per_fit=True`), `ydata` or "
               "`sigma`, not an array `f` closes over")


def _curve_residuals(fns, per_fit, shared, mask, mle=False):
    f, jac = fns
    xdata, ydata, sigma = per_fit
    if shared:
        xdata = shared[0]

    def residual_fn(params):
        try:
            model = f(xdata, params)
        except (ValueError, TypeError, NotImplementedError,
                tf.errors.InvalidArgumentError) as error:
            raise ValueError(
                f"curve_fit: `f(xdata, params)` failed for `params` of shape "
                f"{params.shape.as_list()}, a chunk of the fits ({CHUNKS_TEXT}). "
                f"Received: {type(error).__name__}: {error}") from error
        if model.shape.rank != 2 or model.shape[0] != ydata.shape[0] or \
                model.shape[1] != ydata.shape[1]:
            raise ValueError(
                "curve_fit: `f(xdata, params)` must return [B, N] like `ydata` "
                f"({ydata.shape.as_list()}) for `params` [B, P] "
                f"({params.shape.as_list()}), a chunk of the fits ({CHUNKS_TEXT}). "
                f"Received: shape {model.shape}")
        model = tf.cast(model, ydata.dtype)
        if mle:
            r = poisson.residuals(model, ydata)
        else:
            r = model - ydata if sigma is None else (model - ydata) / sigma
        return r if mask is None else tf.where(mask, r, tf.zeros_like(r))

    def jac_fn(params):
        j = jac(xdata, params)
        if mle and j.shape.rank == 3:
            model = tf.cast(f(xdata, params), ydata.dtype)
            j = tf.cast(j, ydata.dtype) * poisson.residual_derivative(
                model, ydata)[..., None]
        elif j.shape.rank == 3:
            j = tf.cast(j, ydata.dtype)
            j = j if sigma is None else j / sigma[..., None]
        if mask is None or j.shape.rank != 3:
            return j
        return tf.where(mask[..., None], j, tf.zeros_like(j))

    return _with_jacobian(residual_fn, None if jac is None else jac_fn, "curve_fit")


def _fun_residuals(fns, per_fit, shared, mask):
    del shared
    fun, jac = fns

    def residual_fn(x):
        r = fun(x, *per_fit)
        if r.shape.rank != 2 or r.shape[0] != x.shape[0]:
            raise ValueError(
                "least_squares_batched: `fun(x, *args)` must return [B, N] for "
                f"`x` [B, P] ({x.shape.as_list()}). Received: shape {r.shape}")
        if mask is not None and r.shape[1] != mask.shape[1]:
            raise ValueError(
                "least_squares_batched: `mask` must be [B, N] like the residuals "
                f"of `fun` ({r.shape.as_list()}). Received: mask of shape "
                f"{mask.shape.as_list()}")
        r = tf.cast(r, x.dtype)
        return r if mask is None else tf.where(mask, r, tf.zeros_like(r))

    def jac_fn(x):
        j = jac(x, *per_fit)
        if mask is None or j.shape.rank != 3:
            return j
        return tf.where(mask[..., None], j, tf.zeros_like(j))

    return _with_jacobian(residual_fn, None if jac is None else jac_fn,
                          "least_squares_batched")


_RESIDUALS = {"fun": _fun_residuals, "curve": _curve_residuals,
              "curve_mle": lambda *a: _curve_residuals(*a, mle=True)}


def _compiled(kind, fn, options, key, jit_compile, full_output, free, function):
    """The chunk solve for ``fn`` (whose `_identity` is ``function``) and
    these options, from `solve_cache.SOLVES` (`least_squares`'s cache; the
    tf.function keeps one trace per chunk shape and dtype)."""

    found, _ = solve_cache.SOLVES.lookup(
        ("least_squares_batched", kind, function, key, jit_compile, full_output,
         free),
        lambda: _chunk_solve(kind, fn, options, jit_compile, full_output, free))
    return found


def _chunk_solve(kind, fn, options, jit_compile, full_output, free):
    """A new ``tf.function`` of one chunk's solve (`_compiled` caches it)."""
    residuals_of = _residuals_of(kind, fn, free)

    def chunk(x0, per_fit, shared, mask, lower, upper, full0, absolute, tail, unit):
        residual_fn = residuals_of(per_fit, shared, mask, full0)

        def rows_fn(rows):   # the residuals of the problems at ``rows``
            def take(t):
                return None if t is None else tf.gather(t, rows)
            return residuals_of(tf.nest.map_structure(take, per_fit), shared,
                                take(mask), take(full0))

        box = (None if lower is None
               else batched_parts.BatchedBounds(lower, upper))
        if mask is None:
            # Times ``unit`` (1.0, an input): counts that are constants let
            # XLA fold what derives from them into [B]-sized literals (a
            # 10^6-fit chunk spent 16 of its 80 s of compile on one).
            # (curve_fit: N of ``ydata``, without tracing the model once more)
            n = (residual_fn(x0) if kind == "fun" else per_fit[1]).shape[1]
            counts = tf.fill([x0.shape[0]], float(n) * unit)
        else:
            counts = tf.reduce_sum(tf.cast(mask, x0.dtype), axis=1)
        out = batched.solve(residual_fn, x0, options, counts, box, full_output,
                            rows_fn if tail else None)
        r = out.factor
        proven = None
        if r.shape[-1] <= small.COLUMNS_MAX_PARAMS and r.shape[-2] == r.shape[-1]:
            proven = small.proven_covariance(r, out.cost, counts, absolute)
        # The chunk's outputs as the user gets them, the covariance from
        # `proven` (elementwise per fit, so the same here as eagerly after):
        # where every fit's is proven (``ready``) the host only concatenates
        # the chunks (eagerly, ~5 ops over the whole batch and ~3 a chunk
        # took 8% of a 10^5-fit 5x5 call); else, and without `proven` (no
        # ``ready`` then), `finish` computes it.
        report = _report(out, None if proven is None else proven[0], free, full0)
        ready = None if proven is None else tf.reduce_all(proven[1])
        return report, (r, out.cost, counts, proven), ready

    return tf.function(chunk, jit_compile=jit_compile, autograph=False)


def _report(out, cov, free, full0):
    """The `BatchedFitResult` of a chunk's solve ``out`` (of the free
    parameters ``free``, the others at ``full0``) and its covariance ``cov``
    of the free parameters (None: left None). Elementwise per fit."""
    converged = (out.status >= 1) & (out.status <= 3)
    if free is not None:
        spread = fixed_lib.scatter_columns
        p = int(full0.shape[1])
        out = out._replace(
            x=fixed_lib.expand(out.x, full0, free), grad=spread(out.grad, free, p, 1),
            active_mask=spread(out.active_mask, free, p, 1),
            jac=None if out.jac is None else spread(out.jac, free, p, 2))
    result = BatchedFitResult(
        x=out.x, cost=out.cost, converged=converged, status=out.status,
        iterations=out.iterations, covariance=None, perr=None,
        optimality=out.optimality, stationarity=out.stationarity, damping=out.damping,
        grad=out.grad, active_mask=out.active_mask, fun=out.fun, jac=out.jac,
        undetermined=None, stopped_by=out.stopped_by)
    return result if cov is None else _with_covariance(result, cov, free, full0)


def _with_covariance(result, cov, free, full0):
    """``result`` with the covariance ``cov`` of the free parameters: the
    fixed ones' rows and columns 0, NaN for a fit that never ran, and its
    ``perr`` and ``undetermined``."""
    if free is not None:
        spread, p = fixed_lib.scatter_columns, int(full0.shape[1])
        cov = spread(spread(cov, free, p, 1), free, p, 2)
    cov = fit_report.without_covariance(cov, _not_run(result.status))
    return result._replace(covariance=cov, perr=tf.sqrt(tf.linalg.diag_part(cov)),
                           undetermined=fit_report.undetermined(cov))


def _residuals_of(kind, fn, free):
    """``(per_fit, shared, mask, full0) -> residual_fn`` of a chunk."""
    def residuals_of(per_fit, shared, mask, full0):
        fns = (fn if free is None else fixed_lib.reduce_fns(
            "fun" if kind == "fun" else "curve", fn, free, full0))
        return loop_data.attach(   # carried through the compiled loop
            _RESIDUALS[kind](fns, per_fit, shared, mask),
            (per_fit, shared, mask, full0), lambda data: residuals_of(*data))
    return residuals_of


def _stored(kind, fn, options, options_key, full_output, free, function, solve, args):
    """The compiled ``solve`` as a stored module (`module_store`), found or
    written once per process for these options and argument shapes, or
    ``solve`` where modules are not kept. A module is written from a solve
    traced now (`module_store.export`)."""
    residuals_of = _residuals_of(kind, fn, free)

    def probe(x0, per_fit, shared, mask, lower, upper, full0, absolute, tail, unit):
        del unit
        # The user's functions at the chunk's size and, where the solve has
        # a compacted tail (``tail``, `batched.COMPACT_MIN_BATCH`), at the
        # tail's.
        batch = int(x0.shape[0])
        rows = tf.range(max(1, batch // batched.COMPACT_FRACTION))

        def take(t):
            return None if t is None else tf.gather(t, rows)

        calls = []
        sizes = [(x0, per_fit, mask, full0)]
        if tail and batch >= batched.COMPACT_MIN_BATCH:
            sizes.append((take(x0), tf.nest.map_structure(take, per_fit), take(mask),
                          take(full0)))
        for fn_rows in sizes:
            residual_fn = residuals_of(fn_rows[1], shared, fn_rows[2], fn_rows[3])
            calls.append(residual_fn(fn_rows[0]))
            if hasattr(residual_fn, "jacobian"):
                calls.append(residual_fn.jacobian(fn_rows[0]))
        return calls

    shapes = module_store.arguments(args)
    if shapes is None or not module_store.usable():
        return solve
    found, _ = solve_cache.SOLVES.lookup(
        ("stored module", kind, function, options_key, full_output, free, shapes[1]),
        lambda: module_store.stored(
            solve, lambda: _chunk_solve(kind, fn, options, True, full_output, free),
            args, (kind, options_key, full_output, free), probe) or solve)
    return found


def _identity(f):
    if f is None:
        return None
    try:
        return solve_cache.function_key(f)
    except TypeError:
        return solve_cache.Identity(f)


def _solve(kind, fn, x0, per_fit, shared, mask, bounds, opts, batch_size,
           full_output, jit_compile, absolute, name, parameters_to_fit=None,
           progress=False, pad_small=False):
    _check_jit_compile(jit_compile, name)   # before anything runs
    dtype = x0.dtype
    batch, p = int(x0.shape[0]), int(x0.shape[1])
    free = fixed_lib.free_indices(parameters_to_fit, p, name)
    full0 = x0
    if free is not None:
        x_scale = opts.get("x_scale")
        if x_scale is not None and not isinstance(x_scale, str) and np.shape(
                x_scale) == (p,):
            opts = dict(opts, x_scale=np.asarray(x_scale)[list(free)])
        x0 = fixed_lib.take_columns(x0, free)
    options, key = _options(opts, dtype, int(x0.shape[1]), name)
    lower = upper = None
    if bounds is not None:
        lower, upper = _bounds(bounds, batch, p, dtype, name)
        if free is not None and lower is not None:
            lower, upper = (fixed_lib.take_columns(lower, free),
                            fixed_lib.take_columns(upper, free))
    batch_size_given = batch_size
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, (int, np.integer)) or batch_size < 1):
        raise ValueError(f"{name}: `batch_size` must be an integer >= 1 or None. "
                         f"Received: batch_size={batch_size!r}")
    n_points = None   # (unknown for `fun` with a batch_size and no mask)
    if mask is not None:
        n_points = int(mask.shape[1])
    elif kind != "fun":   # curve_fit: N from ydata
        n_points = int(per_fit[1].shape[1])
    elif batch_size is None:  # N from one problem's residuals
        n_points = _residual_count(fn[0], full0, per_fit, name)
    function = tuple(_identity(f) for f in fn)   # (the model, its jac): hashable
    jit_compile, given = _engine(jit_compile, (kind, function, key, full_output, free),
                                 batch)
    if batch_size is None:
        batch_size = max(1, _chunk_budget(jit_compile, dtype)
                         // max(n_points * p, 1))
    size = _chunk_size(batch, batch_size, batch_size_given is None, pad_small)
    solve = _compiled(kind, fn, options, key, jit_compile, full_output, free, function)
    # "auto" chose XLA: a function XLA cannot compile runs plain instead.
    may_fall_back = given is not None and jit_compile
    # (a chunk too small for a tail has none either way: one program for both)
    tail = (bool(jit_compile) and size >= batched.COMPACT_MIN_BATCH
            and (given is not None or batch >= TAIL_MIN_FITS))
    bar = _Progress(batch, name) if progress else None

    pieces = _Pieces(batch, size, (x0, per_fit, mask, lower, upper,
                                   full0 if free is not None else None))

    unit = tf.ones([], dtype)   # `_chunk_solve`'s ``unit``

    def args_at(start):
        x, fit_data, fit_mask, low, high, full = pieces.at(start)
        return (x, fit_data, shared, fit_mask, low, high, full, bool(absolute), tail,
                unit)

    def finish(start, solved):   # the covariance where not proven; the padding dropped
        report, (factor, cost, counts, proven), ready = solved
        if ready is None or not bool(ready):   # a factor not finite or not proven
            finite = tf.reduce_all(tf.math.is_finite(factor), axis=[1, 2])
            cov = batched_parts.covariance(
                tf.where(finite[:, None, None], factor, tf.zeros_like(factor)),
                cost, counts, absolute, proven)
            cov = tf.where(finite[:, None, None], cov, tf.constant(np.nan, dtype))
            report = _with_covariance(report, cov, free, full0)
        keep = min(size, batch - start)
        return report if keep == size else tf.nest.map_structure(
            lambda t: None if t is None else _rows(t, keep), report)

    def done(start):
        if bar is not None:
            bar.update(min(start + size, batch))

    first = args_at(0)
    if jit_compile:   # a stored module where the XLA cache is on (module_store)
        solve = _stored(kind, fn, options, key, full_output, free, function, solve,
                        first)
    # The first chunk alone (it traces and compiles, and may fall back).
    if may_fall_back:
        solved, plain = solve_cache.xla_or_plain(
            solve, lambda: _compiled(kind, fn, options, key, False, full_output,
                                     free, function),
            first, name, given, stacklevel=4)   # the user's curve_fit
        solve = plain or solve
    else:
        solved = solve(*first)
    outputs = [finish(0, solved)]
    done(0)
    if batch > size:   # the other chunks, two at a time where that changes nothing
        if n_points is None:   # each problem's count of residuals, none masked
            n_points = int(tf.reduce_max(solved[1][2]))
        outputs += in_flight.run(
            lambda start: finish(start, solve(*args_at(start))), range(size, batch, size),
            done, chunk_bytes=size * n_points * int(x0.shape[1]) * dtype.size)
    if given is not None:   # counted once the fits ran
        given[0] += batch
    if len(outputs) == 1:
        return outputs[0]
    return tf.nest.map_structure(
        lambda *ts: None if ts[0] is None else tf.concat(ts, axis=0), *outputs)


def _check_eager(name):
    """Refused while a graph is built (inside a user's ``tf.function``): the
    call compiles and runs its chunks itself, and reads their results on the
    host between them (the covariance's test, the chunks' sizes)."""
    if not tf.executing_eagerly():
        raise RuntimeError(
            f"{name} runs eagerly: it compiles each chunk of the fits itself "
            "(`jit_compile`) and reads their results between chunks, so it cannot "
            "be traced into a tf.function. Call it outside the tf.function, with "
            "the data as arrays or eager tensors.")


def _check_jit_compile(jit_compile, name):
    if not isinstance(jit_compile, bool) and jit_compile != "auto":
        raise ValueError(f"{name}: `jit_compile` must be True, False or 'auto'. "
                         f"Received: jit_compile={jit_compile!r}")


def _chunk_budget(compiled, dtype):
    """Jacobian elements a chunk holds when `batch_size` is not given:
    `CHUNK_ELEMENTS` on a GPU; on CPUs `CHUNK_BYTES_CPU_COMPILED` for a
    compiled solve where a core's L2 cache holds that many bytes, else
    `CHUNK_BYTES_CPU`."""
    if tf.config.list_logical_devices("GPU"):
        return CHUNK_ELEMENTS
    if compiled and (_core_l2_bytes() or 0) >= CHUNK_BYTES_CPU_COMPILED:
        return CHUNK_BYTES_CPU_COMPILED // dtype.size
    return CHUNK_BYTES_CPU // dtype.size


@functools.lru_cache(maxsize=None)
def _core_l2_bytes(root="/sys/devices/system/cpu/cpu0/cache"):
    """The first CPU core's level-2 cache in bytes, from Linux's sysfs
    (None where it cannot be read: another system, a container hiding it)."""
    try:
        for entry in sorted(os.listdir(root)):
            folder = os.path.join(root, entry)
            with open(os.path.join(folder, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(folder, "type")) as f:
                kind = f.read().strip()
            if level == "2" and kind in ("Unified", "Data"):
                with open(os.path.join(folder, "size")) as f:
                    size = f.read().strip()
                units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
                if size[-1:] in units:
                    return int(size[:-1]) * units[size[-1]]
                return int(size)
    except (OSError, ValueError):
        return None
    return None


def _chunk_size(batch, budget, ours, pad_small):
    """The fits per chunk for a call of ``batch`` fits, at most ``budget`` a
    chunk (the user's ``batch_size`` when ``ours`` is False: taken as given).

    - A call that fits one chunk: for `curve_fit` (``pad_small``: its per-fit
      data all chunked here) padded up to a size of the form m * 2**k,
      8 <= m < 16 (at most 1/8 more work: 1,000 fits run as 1,024, 70,000 as
      73,728), so that calls of other sizes (a movie's frames) reuse a few
      traces and compiles. Not for `least_squares_batched`, whose `fun` may
      close over its problems' data: such a call runs unpadded there.
    - A call of more: equal chunks of that form, where they save more than
      1/8 of the work of full chunks, whose last one is padded (10,000 5x5
      fits in float32 on a CPU run as two chunks of 5,120, not two of 8,388:
      39% less work); otherwise full chunks, whose one trace serves every
      large call.
      The sizes stay on that grid (between half a chunk and a chunk: at most
      8 of them), so varying large calls reuse a few traces and compiles.
    """
    if not ours or (batch <= budget and not pad_small):
        return int(min(budget, batch))
    if batch <= budget:
        return int(min(budget, _padded(batch)))
    chunks = _ceil_div(batch, budget)
    even = min(budget, _padded(_ceil_div(batch, chunks)))
    work_full, work_even = chunks * budget, _ceil_div(batch, even) * even
    return int(even if work_full - work_even > work_full // 8 else budget)


def _ceil_div(a, b):
    return -(-a // b)


def _padded(batch):
    """``batch`` rounded up to a multiple of 2**(bit length - 4)."""
    step = 1 << max(batch.bit_length() - 4, 0)
    return -(-batch // step) * step


def _engine(jit_compile, key, batch):
    """XLA or not for this call (`AUTO_XLA_FITS`) of the function and options
    ``key`` (hashable), and its record ``[fits given, XLA can compile it]``
    (None when not "auto"): the count is added to once the fits ran."""
    if isinstance(jit_compile, bool):
        return jit_compile, None
    given, _ = _AUTO_FITS.lookup(key, lambda: [0, True])
    # Without the solve cache every call compiles anew: this call's fits only.
    earlier = given[0] if solve_cache.SOLVES.maxsize else 0
    return given[1] and earlier + batch >= AUTO_XLA_FITS, given


class _Pieces:
    """A call's per-fit inputs (a structure of ``[B, ...]`` tensors and
    Nones) chunk by chunk, each chunk ``size`` rows, the last one padded with
    copies of its first row (`_pad`). Split once per call (one op a tensor,
    where the inputs take at most `SPLIT_MAX_BYTES`: a slice a chunk and
    tensor cost ~0.25 ms eagerly, 3% of a 10^5-fit 5x5 call); else sliced
    chunk by chunk (no second copy of large inputs at once)."""

    def __init__(self, batch, size, inputs):
        self.batch, self.size, self.inputs = batch, size, inputs
        leaves = tf.nest.flatten(inputs)
        self.split = None
        if batch > size and sum(t.shape.num_elements() * t.dtype.size for t in leaves
                                if t is not None) <= SPLIT_MAX_BYTES:
            k = batch // size
            sizes = [size] * k + ([batch - k * size] if batch > k * size else [])
            self.split = [None if t is None else tf.split(t, sizes, axis=0)
                          for t in leaves]

    def at(self, start):
        """The padded inputs of the chunk at ``start`` (each chunk's once:
        its pieces are let go, so a call holds one copy of its inputs)."""
        size = self.size
        if self.split is None:
            return tf.nest.map_structure(
                lambda t: None if t is None else _pad(tf.slice(
                    t, [start] + [0] * (t.shape.rank - 1),
                    [min(size, self.batch - start)] + [-1] * (t.shape.rank - 1)), size),
                self.inputs)
        i = start // size
        taken = []
        for parts in self.split:   # (two threads take other chunks' pieces)
            taken.append(None if parts is None else _pad(parts[i], size))
            if parts is not None:
                parts[i] = None
        return tf.nest.pack_sequence_as(self.inputs, taken)


# (see `_Pieces`: 2**27 bytes, 32x the CPU's default chunk of Jacobian)
SPLIT_MAX_BYTES = 2 ** 27


class _Progress:
    """A text progress bar across chunks (Keras-free: core stays pure TF)."""

    WIDTH = 30

    def __init__(self, total, name):
        self.total, self.name = total, name

    def update(self, done):
        filled = self.WIDTH * done // self.total
        end = "\n" if done >= self.total else ""
        print(f"\r{self.name}: {done}/{self.total} fits "
              f"[{'=' * filled}{'.' * (self.WIDTH - filled)}]", end=end, flush=True)


def _not_run(status):
    """[B] bool: fits that never ran (non-finite or infeasible start, no
    data): their covariance is NaN."""
    return tf.reduce_any(status[:, None] == tf.constant(batched.NOT_RUN, status.dtype),
                         axis=1)


def _residual_count(fn, x0, per_fit, name):
    """N from the residuals of the first problem, refused naming `fun`
    unless they are [1, N]."""
    r = fn(x0[:1], *tf.nest.map_structure(lambda t: t[:1], per_fit))
    shape = getattr(r, "shape", np.shape(r))
    if len(shape) != 2:
        raise ValueError(
            f"{name}: `fun(x, *args)` must return the residuals [B, N] (one row "
            f"per problem) for `x` [B, P]. Received: shape {list(shape)} for "
            f"`x` of shape {x0[:1].shape.as_list()}.")
    return int(shape[-1])


def _data_dtype(p0, ydata):
    """`curve_fit`'s default dtype: the float arrays' promoted dtype (float32
    data stay float32, a speed default: half the memory traffic and twice
    the SIMD lanes), float64 without one."""
    found = []
    for a in (p0, ydata):
        dtype = getattr(a, "dtype", None)
        if dtype is not None and tf.as_dtype(dtype) in (tf.float32, tf.float64):
            found.append(tf.as_dtype(dtype).as_numpy_dtype)
    return tf.as_dtype(np.result_type(*found)) if found else tf.float64


def _pad(t, size):
    """``t`` [k, ...] padded to ``size`` rows with copies of its first row."""
    k = int(t.shape[0])
    if k == size:
        return t
    copies = tf.broadcast_to(_rows(t, 1), [size - k] + t.shape[1:].as_list())
    return tf.concat([t, copies], axis=0)


def _rows(t, k):
    """The first ``k`` rows of ``t`` (one op: ``t[:k]`` costs several eagerly)."""
    return tf.slice(t, [0] * t.shape.rank, [k] + [-1] * (t.shape.rank - 1))


def _is_float(a):
    dtype = getattr(a, "dtype", None)
    if dtype is None:
        dtype = np.asarray(a).dtype
    return tf.as_dtype(dtype).is_floating


def _parameters(x0, name, dtype=None):
    if dtype is None:
        dtype = getattr(x0, "dtype", None)
        dtype = (tf.as_dtype(dtype) if dtype is not None
                 and tf.as_dtype(dtype) in (tf.float32, tf.float64) else tf.float64)
    else:
        dtype = tf.as_dtype(dtype)
        if dtype not in (tf.float32, tf.float64):
            raise ValueError("curve_fit: `dtype` must be float32 or float64. "
                             f"Received: dtype={dtype.name}")
    if np.iscomplexobj(x0) or (hasattr(x0, "dtype") and tf.as_dtype(
            x0.dtype).is_complex):
        raise ValueError(f"`{name}` must be real. Received: dtype {x0.dtype}")
    x0 = tf.cast(x0, dtype)
    if x0.shape.rank != 2 or x0.shape[0] == 0 or x0.shape[1] == 0:
        raise ValueError(f"`{name}` must be [B, P] (B problems of P parameters, "
                         f"both >= 1). Received: shape {x0.shape.as_list()}")
    return x0, dtype


def _batched(a, dtype, batch, name, rank=None):
    t = tf.convert_to_tensor(a) if dtype is None else tf.cast(a, dtype)
    if t.shape.rank == 0 or int(t.shape[0]) != batch or (
            rank is not None and t.shape.rank != rank):
        want = f"[B, ...] with B = {batch}" if rank is None else f"[{batch}, N]"
        raise ValueError(f"`{name}` must be {want} (one row per problem, like the "
                         f"starts). Received: shape {t.shape.as_list()}")
    return t


def _mask(mask, batch, n, name):
    t = tf.convert_to_tensor(mask)
    if t.dtype != tf.bool:
        raise ValueError(f"`{name}` must be bool (False at padding). Received: "
                         f"dtype {t.dtype.name}")
    if t.shape.rank != 2 or int(t.shape[0]) != batch or (
            n is not None and int(t.shape[1]) != n):
        raise ValueError(f"`{name}` must be [B, N] = [{batch}, {n or 'N'}]. "
                         f"Received: shape {t.shape.as_list()}")
    return t


def _single_bounds(bounds):
    if bounds is None or hasattr(bounds, "lb"):
        return bounds
    if isinstance(bounds, (tuple, list)) and len(bounds) == 2:
        return tuple(b if np.ndim(b) == 0 else np.asarray(b)[None] for b in bounds)
    return bounds


def _bounds(bounds, batch, p, dtype, name):
    if hasattr(bounds, "lb") and hasattr(bounds, "ub"):
        bounds = (bounds.lb, bounds.ub)
    if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2):
        raise ValueError(f"{name}: `bounds` must be a pair (lower, upper). "
                         f"Received: bounds={bounds!r}")
    sides = []
    for side, which in zip(bounds, ("lower", "upper")):
        a = np.asarray(side, np.float64)
        if a.shape not in ((), (p,), (batch, p)):
            raise ValueError(
                f"{name}: `bounds` {which} must be a scalar, [P] = [{p}] or "
                f"[B, P] = [{batch}, {p}]. Received: shape {a.shape}")
        sides.append(np.broadcast_to(a, (batch, p)))
    lower, upper = sides
    bad = np.isnan(lower) | np.isnan(upper) | (lower >= upper)
    if bad.any():
        b, j = np.argwhere(bad)[0]
        raise ValueError(f"{name}: every lower bound must be below its upper bound "
                         f"(as scipy). Received: lower[{b}, {j}]={lower[b, j]}, "
                         f"upper[{b}, {j}]={upper[b, j]}.")
    if np.isinf(lower).all() and np.isinf(upper).all():
        return None, None
    return tf.constant(lower, dtype), tf.constant(upper, dtype)


def _options(opts, dtype, p, name):
    """(`batched.BatchedOptions`, a hashable key of them)."""
    eps = float(np.finfo(dtype.as_numpy_dtype).eps)
    max_iterations = opts["max_iterations"]
    if isinstance(max_iterations, bool) or not isinstance(
            max_iterations, (int, np.integer)) or max_iterations < 0:
        raise ValueError(f"{name}: `max_iterations` must be an integer >= 0. "
                         f"Received: max_iterations={max_iterations!r}")
    max_attempts = opts.get("max_attempts", 10)
    if isinstance(max_attempts, bool) or not isinstance(
            max_attempts, (int, np.integer)) or max_attempts < 1:
        raise ValueError(f"{name}: `max_attempts` must be an integer >= 1. "
                         f"Received: max_attempts={max_attempts!r}")
    tolerances = {k: opts.get(k) for k in ("gtol", "xtol", "ftol")}
    for k, v in tolerances.items():
        if v is not None and (isinstance(v, bool) or not isinstance(
                v, (int, float)) or not v >= 0):
            raise ValueError(f"{name}: `{k}` must be a number >= 0 or None. "
                             f"Received: {k}={v!r}")
    if all(v is not None and v < eps for v in tolerances.values()):
        raise ValueError(f"{name}: at least one of `gtol`, `xtol`, `ftol` must be "
                         f"above the machine epsilon of {dtype.name} ({eps:.3g}). "
                         f"Received: {tolerances}")
    robust = RobustLoss(opts["loss"], opts["f_scale"])
    controller = resolve_part(opts.get("controller", "trust_region"),
                              damping_lib.CONTROLLERS, "controller")
    solver_name = small.resolve_solver(opts.get("solver", "auto"), p)
    if solver_name not in batched_parts.SOLVERS:
        raise ValueError(f"{name}: `solver` must be one of "
                         f"{sorted(batched_parts.SOLVERS) + ['auto']} for batched "
                         "problems. "
                         f"Received: solver={solver_name!r}")
    solver = batched_parts.SOLVERS[solver_name]()
    scaling, x_scale = opts.get("scaling"), opts.get("x_scale")
    if x_scale is not None:
        if scaling is not None:
            raise ValueError(f"{name}: pass `scaling` or `x_scale`, not both. "
                             f"Received: scaling={scaling!r}, x_scale={x_scale!r}")
        if isinstance(x_scale, str):
            if x_scale != "jac":
                raise ValueError(f"{name}: `x_scale` must be 'jac' or positive "
                                 f"numbers. Received: x_scale={x_scale!r}")
            scaling = damping_lib.Marquardt()
        else:
            scaling = damping_lib.XScale(x_scale)
            scaling.init(p, dtype)  # checks the count
    if scaling is None:
        scaling = "marquardt" if robust.is_linear else "hybrid"
    scaling = resolve_part(scaling, damping_lib.SCALINGS, "scaling")
    options = batched.BatchedOptions(
        controller=controller, scaling=scaling, solver=solver, loss=robust,
        max_iterations=int(max_iterations), max_attempts=int(max_attempts),
        gtol=eps if tolerances["gtol"] is None else float(tolerances["gtol"]),
        xtol=eps ** 0.75 if tolerances["xtol"] is None else float(tolerances["xtol"]),
        ftol=4 * eps if tolerances["ftol"] is None else float(tolerances["ftol"]))

    part_key = solve_cache.part_key
    key = (part_key(controller), part_key(scaling), solver_name, robust.name,
           robust.f_scale, options.max_iterations, options.max_attempts,
           options.gtol, options.xtol, options.ftol, dtype.name)
    return options, key
