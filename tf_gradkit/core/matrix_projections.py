"""Exact projections whose sets couple the entries of a tensor: orthonormal
frames, monotone sequences and positive semidefinite matrices. Pure TensorFlow.

Like `tf_gradkit.core.projections`, each function returns the nearest point
of its set in the Frobenius (Euclidean) norm, is idempotent up to rounding,
computes in float32 at least (bfloat16/float16 are cast up and back), and
runs eagerly, in `tf.function` and under ``jit_compile=True``:

* `project_orthogonal`: the polar factor ``U V^T`` by a Newton-Schulz
  iteration (matrix products only; no SVD, which XLA runs very slowly on a
  CPU: docs/constraints.md, "Measured cost of the matrix projections").
* `project_monotone`: isotonic regression by the max-min formula over block
  means, vectorised (no data-dependent loops, no host syncs).
* `project_psd`: clip the eigenvalues of the symmetric part (one
  `tf.linalg.eigh`).

Measured times of each projection (eager and under ``jit_compile=True``):
docs/constraints.md, "Measured cost of the matrix projections".

References:
  N. J. Higham, "Functions of Matrices", SIAM 2008, ch. 8 (polar
  decomposition: the polar factor as the nearest orthonormal matrix, and
  the Newton-Schulz iteration).
  R. E. Barlow, D. J. Bartholomew, J. M. Bremner, H. D. Brunk, "Statistical
  Inference under Order Restrictions", Wiley 1972 (the max-min formula and
  PAVA for isotonic regression).
  N. J. Higham, "Computing a nearest symmetric positive semidefinite matrix",
  Linear Algebra Appl. 103 (1988) 103-118.
"""

import tensorflow as tf

from tf_gradkit.core import precision
from tf_gradkit.core import projections


_wide = projections.wide_dtype


def _spectral_bound(gram):
    """An upper bound ``b >= sigma_max(X)`` from ``G = X^T X``, within a factor
    ``n^(1/32)`` (<= 1.25 for n <= 1024): ``b = |G^8|_F^(1/16)``, by three
    normalised squarings so nothing overflows."""
    norm = tf.norm(gram)
    log_b = 0.5 * tf.math.log(norm)
    a = gram / norm
    for power in (4.0, 8.0, 16.0):
        a = precision.matmul(a, a)
        norm = tf.norm(a)
        log_b += tf.math.log(norm) / power
        a = a / norm
    return tf.exp(log_b)


def project_orthogonal(x, max_iters=100):
    """Nearest matrix with orthonormal columns (or rows): the polar factor.

    For ``x`` of shape ``[m, n]`` with ``m >= n`` the result ``Q`` has
    ``Q^T Q = I_n`` and is ``argmin |Q - x|_F`` over such matrices, namely
    ``U V^T`` for the thin SVD ``x = U S V^T`` (Higham 2008, ch. 8); for
    ``m < n`` the rows are made orthonormal (``Q Q^T = I_m``). A tensor of rank
    > 2 (a conv kernel ``[h, w, c_in, c_out]``) is treated as the matrix
    ``[h * w * c_in, c_out]`` and reshaped back.

    Method: scale ``X_0 = x / b`` with ``b >= sigma_max`` (so every singular
    value is in ``(0, 1]``), then iterate Newton-Schulz

        X_{k+1} = X_k (3 I - X_k^T X_k) / 2,

    which maps each singular value ``s -> s (3 - s^2) / 2``: it grows by 1.5x
    while small and converges quadratically to 1 once all are near 1, leaving
    ``U`` and ``V`` unchanged. A `tf.while_loop` stops when the residual
    ``r_k = |X_k^T X_k - I|_F`` was below 0.5 (the quadratic regime, where
    exact steps at least halve it) and stopped halving (it reached its
    rounding floor), or after ``max_iters``.
    Matrix products only, in the orientation with the small Gram matrix,
    through `tf_gradkit.core.precision` (float32-accurate under TF32).

    Exactness: for a full-rank input the result is the polar factor to
    working precision (errors ~ eps * cond(x); columns orthonormal to
    ~ sqrt(n) * eps). Iterations needed: about ``log_1.5(cond(x)) + 6``
    (~20 for a random Gaussian 256 x 256, ~9 for 1024 x 256).
    Rank-deficient input: the nearest orthonormal matrix is not unique.
    Singular values that are exactly 0 stay 0, so after ``max_iters`` the
    result is the partial isometry ``U_r V_r^T`` (NOT orthonormal: check
    ``Q^T Q`` if your weights can lose rank); an all-zero input returns zeros.
    Singular values that are merely tiny (or seeded by rounding) are grown to
    1, i.e. the null space is completed in an arbitrary orthonormal way, at
    the cost of ``log_1.5(1 / sigma_min)`` extra iterations.

    Cost: ``O(iters * m * n^2)`` flops for ``m >= n`` (two products per
    iteration) plus three ``n x n`` products for the scale; memory ``O(m n)``.
    Measured times and error: docs/constraints.md.

    Args:
      x: a float tensor of rank >= 2.
      max_iters: cap on Newton-Schulz iterations (100 covers condition
        numbers far beyond float32's 1 / eps).

    Returns:
      A tensor of ``x``'s shape and dtype with orthonormal columns (rows if
      the flattened matrix is wide).

    Raises:
      ValueError: if ``x`` has rank < 2 or a shape not known statically.

    Example:
      >>> q = project_orthogonal(tf.random.normal([64, 16]))
      >>> err = tf.norm(tf.transpose(q) @ q - tf.eye(16))  # ~1e-6
    """
    x = tf.convert_to_tensor(x)
    if x.shape.rank is None or x.shape.rank < 2:
        raise ValueError("project_orthogonal: needs a tensor of rank >= 2 (a matrix or "
                         f"a kernel [..., c_in, c_out]). Received shape {x.shape}.")
    m, n = x.shape[:-1].num_elements(), x.shape[-1]
    if m is None or n is None:
        raise ValueError("project_orthogonal: the shape must be known statically. "
                         f"Received shape {x.shape}.")
    wide = _wide(x)
    mat = tf.reshape(tf.cast(x, wide), [m, n])
    wide_matrix = m < n
    if wide_matrix:
        mat = tf.transpose(mat)
    eye = tf.eye(min(m, n), dtype=wide)
    gram = precision.gram(mat)
    tiny = tf.constant(1e-30, wide) if wide != tf.float64 else tf.constant(1e-300, wide)
    nonzero = tf.norm(gram) > tiny
    bound = _spectral_bound(tf.where(nonzero, gram, eye))
    mat = tf.where(nonzero, mat / bound, tf.zeros_like(mat))
    gram = tf.where(nonzero, gram / tf.square(bound), tf.zeros_like(gram))

    def residual(g):
        return tf.norm(g - eye)

    def keep_going(i, mat, gram, res, prev):
        del mat, gram
        # Once r < 0.5 every |s^2 - 1| < 0.5, where one step multiplies it by
        # |d| (3 - d) / 4 <= 0.44: so from there on, r must at least halve
        # until rounding stops it.
        improving = tf.logical_or(prev >= 0.5, res < 0.5 * prev)
        return tf.logical_and(i < max_iters, improving)

    def step(i, mat, gram, res, prev):
        mat = 1.5 * mat - 0.5 * precision.matmul(mat, gram)
        gram = precision.gram(mat)
        return i + 1, mat, gram, residual(gram), res

    inf = tf.constant(float("inf"), wide)
    _, mat, _, _, _ = tf.while_loop(
        keep_going, step, (tf.constant(0), mat, gram, residual(gram), inf))
    if wide_matrix:
        mat = tf.transpose(mat)
    return tf.cast(tf.reshape(mat, x.shape), x.dtype)


def _scan_doubling(x, combine, fill, reverse):
    """Inclusive scan of ``combine`` (min or max) along the last axis, in
    ``ceil(log2 n)`` shifted elementwise steps (Hillis-Steele): XLA-friendly,
    ``O(n log n)`` work per row. Needs a static last dimension."""
    n = x.shape[-1]
    shift = 1
    while shift < n:
        pad = tf.fill(tf.concat([tf.shape(x)[:-1], [shift]], 0), fill)
        if reverse:   # out[k] = combine(x[k], x[k + shift])
            moved = tf.concat([x[..., shift:], pad], axis=-1)
        else:         # out[k] = combine(x[k], x[k - shift])
            moved = tf.concat([pad, x[..., :-shift]], axis=-1)
        x = combine(x, moved)
        shift *= 2
    return x


def project_monotone(x, axis=-1, increasing=True):
    """Each slice along ``axis`` onto non-decreasing (or non-increasing)
    sequences: isotonic regression, exact.

    The projection of ``y_1..y_n`` onto ``{z_1 <= ... <= z_n}`` is
    piecewise constant on blocks, each equal to its block mean, and has the
    max-min closed form (Barlow et al. 1972, ch. 1)

        z_i = max_{j <= i} min_{k >= i} mean(y_j, ..., y_k).

    Vectorised over each slice: an ``n x n`` matrix of block means
    ``M[j, k]`` (a cumulative sum of ``y`` masked to ``k >= j``, so each
    mean is summed from its own entries only: no cancellation between
    prefix sums), a reverse cumulative min over ``k`` and a masked max over
    ``j``, the cumulative min by ``ceil(log2 n)`` shifted-min steps. Every
    output is one computed block mean (selected, not re-added), so a
    monotone input is returned to within a few ulps. Non-increasing is the
    negation of the non-decreasing projection of ``-y``.

    Cost: ``O(n^2 log n)`` work and ``O(n^2)`` memory per slice (the other
    axes are a batch): fine up to a few thousand entries per slice. PAVA is
    ``O(n)`` but sequential and data-dependent, a poor fit for XLA.
    Measured times: docs/constraints.md.

    Args:
      x: a float tensor.
      axis: the axis along which entries must be monotone. Its length must
        be known statically.
      increasing: ``True`` for non-decreasing, ``False`` for non-increasing.

    Returns:
      A tensor of ``x``'s shape and dtype.

    Raises:
      ValueError: if ``x`` is a scalar or ``axis`` has unknown length.

    Example:
      >>> project_monotone(tf.constant([1.0, 3.0, 2.0, 4.0])).numpy()
      array([1. , 2.5, 2.5, 4. ], dtype=float32)
    """
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    if rank is None or rank == 0:
        raise ValueError("project_monotone: needs a tensor of rank >= 1. "
                         f"Received shape {x.shape}.")
    if not -rank <= axis < rank:
        raise ValueError(f"project_monotone: `axis` must be in [-{rank}, {rank}) for "
                         f"shape {x.shape}. Received: axis={axis!r}")
    n = x.shape[axis]
    if n is None:
        raise ValueError(f"project_monotone: the length of axis {axis} must be known "
                         f"statically. Received shape {x.shape}.")
    if n <= 1:
        return x
    wide = _wide(x)
    y = tf.experimental.numpy.moveaxis(tf.cast(x, wide), axis, -1)
    if not increasing:
        y = -y
    j = tf.range(n)[:, None]
    k = tf.range(n)[None, :]
    upper = k >= j                                              # [n, n]: block j..k
    rows = tf.where(upper, y[..., None, :], tf.zeros([], wide))  # [..., j, k]
    sums = tf.cumsum(rows, axis=-1)                             # sum(y_j..y_k)
    counts = tf.cast(tf.maximum(k - j + 1, 1), wide)
    inf = tf.constant(float("inf"), wide)
    means = tf.where(upper, sums / counts, inf)                 # M[j, k]
    # R[j, i] = min_{k >= i} M[j, k]; then z_i = max_{j <= i} R[j, i].
    tail_min = _scan_doubling(means, tf.minimum, inf, reverse=True)
    z = tf.reduce_max(tf.where(upper, tail_min, -inf), axis=-2)
    if not increasing:
        z = -z
    return tf.cast(tf.experimental.numpy.moveaxis(z, -1, axis), x.dtype)


def project_psd(x):
    """Nearest symmetric positive semidefinite matrix (Frobenius norm).

    For square ``x`` the minimiser of ``|Z - x|_F`` over symmetric PSD ``Z``
    is ``V max(L, 0) V^T`` where ``(x + x^T) / 2 = V L V^T`` (Higham 1988,
    Thm. 2.1): the skew part is orthogonal to every symmetric matrix, and
    within the symmetric ones clipping the eigenvalues is the projection.
    Batches ``[..., n, n]`` are projected matrix by matrix. The result is
    symmetrised once more so it is exactly symmetric.

    Exactness: to the accuracy of ``eigh`` (backward stable: ~ n * eps *
    |x|); a PSD input is returned up to that rounding (eigenvalues that are
    zero may come back as ~ -eps |x| and be clipped to 0).

    Cost: one symmetric eigendecomposition, ``O(n^3)``. Under XLA on CPU
    ``eigh`` is a Jacobi iteration and much slower than LAPACK (measured
    times: docs/constraints.md); cost grows ~n^3, so keep jitted CPU uses to
    a few hundred.
    Prefer small blocks (e.g. covariance or metric matrices of a few
    hundred) inside compiled train steps.

    Args:
      x: a float tensor of shape ``[..., n, n]``.

    Returns:
      A symmetric PSD tensor of ``x``'s shape and dtype.

    Raises:
      ValueError: if the last two dimensions are not equal (or rank < 2).

    Example:
      >>> project_psd(tf.constant([[1.0, 0.0], [0.0, -2.0]])).numpy()
      array([[1., 0.], [0., 0.]], dtype=float32)
    """
    x = tf.convert_to_tensor(x)
    if x.shape.rank is None or x.shape.rank < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError("project_psd: needs square matrices [..., n, n]. "
                         f"Received shape {x.shape}.")
    wide = _wide(x)
    xw = tf.cast(x, wide)
    sym = 0.5 * (xw + tf.linalg.matrix_transpose(xw))
    eigvals, eigvecs = tf.linalg.eigh(sym)
    clipped = tf.maximum(eigvals, tf.zeros_like(eigvals))
    out = precision.matmul(eigvecs * clipped[..., None, :], eigvecs, transpose_b=True)
    out = 0.5 * (out + tf.linalg.matrix_transpose(out))
    return tf.cast(out, x.dtype)
