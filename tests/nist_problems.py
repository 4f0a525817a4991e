"""NIST StRD nonlinear least-squares reference problems, as TensorFlow models.

The Statistical Reference Datasets (StRD) of NIST give, for each problem, a
model formula, two starting points ("Start 1" far from the solution, "Start 2"
closer), certified parameter values (computed in 128-bit arithmetic and given
to 11 significant digits) with their standard deviations, the certified
residual sum of squares and the data. This module parses the `.dat` files of
`shared/nist/` and pairs each with its model, written by hand from the file's
header.

Each model is ``model(b, x, xp=tf.math)``: ``b`` is a sequence of scalar
parameters (a list of scalar ``tf.Variable``s, a 1-D tensor or a 1-D numpy
array), ``x`` the predictor(s) and ``xp`` the module holding ``exp``, ``log``,
``cos``, ``sin`` and ``atan``. With the default it is a TensorFlow function;
``xp=numpy`` evaluates the same formula in numpy, so that a scipy baseline
is timed without TensorFlow's per-call overhead.

Two problems do not fit the plain ``y = f(b, x)`` shape and are adapted as
NIST defines them:

- Nelson has two predictors (x1 = time, x2 = temperature): its ``x`` is an
  ``(n, 2)`` array;
- Nelson's model is ``log[y] = b1 - b2*x1*exp(-b3*x2)``: its certified
  residual sum of squares is taken on the log scale, so ``Problem.y`` holds
  ``log(y)`` (the raw column is in ``Problem.y_raw``).

Not a test module (no pytest import), so that `benchmarks/` can import it too
(with ``tests/`` on ``sys.path``).

Reference: NIST StRD, Nonlinear Regression,
https://www.itl.nist.gov/div898/strd/nls/nls_main.shtml
"""

import math
import pathlib
import re
from typing import Callable, List, NamedTuple

import numpy as np
import tensorflow as tf

# In CI the repository is cloned with `shared/` beside it.
_BESIDE_REPO = pathlib.Path(__file__).resolve().parents[2] / "shared" / "nist"
_FALLBACK = pathlib.Path("/work/shared/nist")
NIST_DIR = _BESIDE_REPO if _BESIDE_REPO.is_dir() else _FALLBACK

LRE_CAP = 15.0


# --------------------------------------------------------------------------
# Models, one per formula in the headers (b1..bk are b[0]..b[k-1]).
# --------------------------------------------------------------------------
def chwirut(b, x, xp=tf.math):
    """Chwirut1, Chwirut2: y = exp(-b1*x) / (b2 + b3*x)."""
    return xp.exp(-b[0] * x) / (b[1] + b[2] * x)


def danwood(b, x, xp=tf.math):
    """DanWood: y = b1 * x**b2."""
    del xp
    return b[0] * x ** b[1]


def enso(b, x, xp=tf.math):
    """ENSO: a yearly cycle plus two cycles of fitted periods b4 and b7.

    y = b1 + b2*cos(2 pi x/12) + b3*sin(2 pi x/12)
           + b5*cos(2 pi x/b4) + b6*sin(2 pi x/b4)
           + b8*cos(2 pi x/b7) + b9*sin(2 pi x/b7)
    """
    yearly = 2.0 * math.pi * x / 12.0
    second = 2.0 * math.pi * x / b[3]
    third = 2.0 * math.pi * x / b[6]
    return (b[0] + b[1] * xp.cos(yearly) + b[2] * xp.sin(yearly)
            + b[4] * xp.cos(second) + b[5] * xp.sin(second)
            + b[7] * xp.cos(third) + b[8] * xp.sin(third))


def gauss(b, x, xp=tf.math):
    """Gauss1-3: y = b1*exp(-b2*x) + b3*exp(-(x-b4)**2/b5**2)
                                   + b6*exp(-(x-b7)**2/b8**2)."""
    return (b[0] * xp.exp(-b[1] * x)
            + b[2] * xp.exp(-(x - b[3]) ** 2 / b[4] ** 2)
            + b[5] * xp.exp(-(x - b[6]) ** 2 / b[7] ** 2))


def hahn1(b, x, xp=tf.math):
    """Hahn1: y = (b1 + b2*x + b3*x**2 + b4*x**3) / (1 + b5*x + b6*x**2 + b7*x**3)."""
    del xp
    numerator = b[0] + b[1] * x + b[2] * x ** 2 + b[3] * x ** 3
    denominator = 1.0 + b[4] * x + b[5] * x ** 2 + b[6] * x ** 3
    return numerator / denominator


def kirby2(b, x, xp=tf.math):
    """Kirby2: y = (b1 + b2*x + b3*x**2) / (1 + b4*x + b5*x**2)."""
    del xp
    return (b[0] + b[1] * x + b[2] * x ** 2) / (1.0 + b[3] * x + b[4] * x ** 2)


def lanczos(b, x, xp=tf.math):
    """Lanczos1-3: y = b1*exp(-b2*x) + b3*exp(-b4*x) + b5*exp(-b6*x)."""
    return (b[0] * xp.exp(-b[1] * x) + b[2] * xp.exp(-b[3] * x)
            + b[4] * xp.exp(-b[5] * x))


def mgh17(b, x, xp=tf.math):
    """MGH17: y = b1 + b2*exp(-x*b4) + b3*exp(-x*b5)."""
    return b[0] + b[1] * xp.exp(-x * b[3]) + b[2] * xp.exp(-x * b[4])


def misra1a(b, x, xp=tf.math):
    """Misra1a: y = b1 * (1 - exp(-b2*x))."""
    return b[0] * (1.0 - xp.exp(-b[1] * x))


def misra1b(b, x, xp=tf.math):
    """Misra1b: y = b1 * (1 - (1 + b2*x/2)**(-2))."""
    del xp
    return b[0] * (1.0 - (1.0 + b[1] * x / 2.0) ** -2.0)


def misra1c(b, x, xp=tf.math):
    """Misra1c: y = b1 * (1 - (1 + 2*b2*x)**(-1/2))."""
    del xp
    return b[0] * (1.0 - (1.0 + 2.0 * b[1] * x) ** -0.5)


def misra1d(b, x, xp=tf.math):
    """Misra1d: y = b1*b2*x * (1 + b2*x)**(-1)."""
    del xp
    return b[0] * b[1] * x / (1.0 + b[1] * x)


def nelson(b, x, xp=tf.math):
    """Nelson: log(y) = b1 - b2*x1 * exp(-b3*x2); x is (n, 2) = (time, temperature)."""
    x1, x2 = x[:, 0], x[:, 1]
    return b[0] - b[1] * x1 * xp.exp(-b[2] * x2)


def roszman1(b, x, xp=tf.math):
    """Roszman1: y = b1 - b2*x - arctan(b3 / (x - b4)) / pi."""
    return b[0] - b[1] * x - xp.atan(b[2] / (x - b[3])) / math.pi


MODELS = {
    "Chwirut1": chwirut,
    "Chwirut2": chwirut,
    "DanWood": danwood,
    "ENSO": enso,
    "Gauss1": gauss,
    "Gauss2": gauss,
    "Gauss3": gauss,
    "Hahn1": hahn1,
    "Kirby2": kirby2,
    "Lanczos1": lanczos,
    "Lanczos2": lanczos,
    "Lanczos3": lanczos,
    "MGH17": mgh17,
    "Misra1a": misra1a,
    "Misra1b": misra1b,
    "Misra1c": misra1c,
    "Misra1d": misra1d,
    "Nelson": nelson,
    "Roszman1": roszman1,
}

# Responses that the model predicts on a transformed scale (see module doc).
_RESPONSE_TRANSFORMS = {"Nelson": np.log}


# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------
class Problem(NamedTuple):
    """One StRD problem.

    Attributes:
      name: dataset name, e.g. "Misra1a".
      model: ``model(b, x, xp=tf.math)``, the fitted response as a function
        of the parameters (see module doc).
      x: predictor(s), float64, shape ``(n,)`` (``(n, 2)`` for Nelson).
      y: the response the model predicts, float64, shape ``(n,)``
        (``log`` of the data column for Nelson).
      starts: ``[start1, start2]``, float64 arrays of shape ``(k,)``.
      certified: certified parameter values, shape ``(k,)``.
      certified_sd: their certified standard deviations, shape ``(k,)``.
      certified_rss: certified residual sum of squares.
      y_raw: the response column exactly as in the file.
      formula: the model lines of the file's header.
    """
    name: str
    model: Callable
    x: np.ndarray
    y: np.ndarray
    starts: List[np.ndarray]
    certified: np.ndarray
    certified_sd: np.ndarray
    certified_rss: float
    y_raw: np.ndarray
    formula: str


_PARAM_LINE = re.compile(r"^\s*b(\d+)\s*=\s*(.*)$")
_RSS_LINE = re.compile(r"^\s*Residual Sum of Squares:\s*(\S+)")
_N_OBS_LINE = re.compile(r"^\s*Number of Observations:\s*(\d+)")
_N_PARAMS_LINE = re.compile(r"^\s*(\d+) Parameters")


def parse_dat(path):
    """Reads one StRD `.dat` file into a dict of numpy arrays.

    Args:
      path: the `.dat` file.

    Returns:
      dict with keys ``starts`` (2, k), ``certified`` (k,), ``certified_sd``
      (k,), ``certified_rss``, ``columns`` (the names after ``Data:``),
      ``data`` (n, len(columns)) and ``formula`` (the header's model lines).

    Raises:
      ValueError: if the file lacks one of those sections, or the numbers of
        parameters or observations differ from those its header announces.
    """
    lines = pathlib.Path(path).read_text().splitlines()
    params, rss, data_at, model_at = {}, None, None, None
    n_obs = n_params = None
    for i, line in enumerate(lines):
        match = _PARAM_LINE.match(line)
        if match:
            values = [float(v) for v in match.group(2).split()]
            if len(values) != 4:
                raise ValueError(f"{path}: line {i + 1}: expected start 1, start 2, "
                                 f"certified value, sd; got {line!r}")
            params[int(match.group(1))] = values
        match = _RSS_LINE.match(line)
        if match:
            rss = float(match.group(1))
        match = _N_OBS_LINE.match(line)
        if match:
            n_obs = int(match.group(1))
        match = _N_PARAMS_LINE.match(line)
        if match and n_params is None:
            n_params = int(match.group(1))
        if line.startswith("Model:"):
            model_at = i
        # The first "Data:" line describes the variables; the last one heads
        # the columns.
        if line.startswith("Data:"):
            data_at = i
    if not params or rss is None or data_at is None or model_at is None:
        raise ValueError(f"{path}: missing parameters, residual sum of squares, "
                         "model or data section")
    if sorted(params) != list(range(1, (n_params or 0) + 1)):
        raise ValueError(f"{path}: header announces {n_params} parameters; "
                         f"found b{sorted(params)}")
    table = np.array([params[j] for j in range(1, len(params) + 1)], dtype=np.float64)
    columns = lines[data_at].split()[1:]
    data = np.array([[float(v) for v in line.split()]
                     for line in lines[data_at + 1:] if line.strip()],
                    dtype=np.float64)
    if data.ndim != 2 or data.shape != (n_obs, len(columns)):
        raise ValueError(f"{path}: data has shape {data.shape}; the header announces "
                         f"{n_obs} observations of columns {columns}")
    formula_lines = []
    for line in lines[model_at + 2:]:
        if "Starting" in line:
            break
        if line.strip():
            formula_lines.append(" ".join(line.split()))
    return {
        "starts": table[:, :2].T.copy(),
        "certified": table[:, 2].copy(),
        "certified_sd": table[:, 3].copy(),
        "certified_rss": rss,
        "columns": columns,
        "data": data,
        "formula": " ".join(formula_lines),
    }


def load_problem(name, directory=None):
    """Parses ``<directory>/<name>.dat`` and pairs it with its model."""
    parsed = parse_dat(pathlib.Path(directory or NIST_DIR) / f"{name}.dat")
    if parsed["columns"][0] != "y":
        raise ValueError(f"{name}: first data column is {parsed['columns'][0]!r}, not y")
    y_raw = parsed["data"][:, 0]
    x = parsed["data"][:, 1:]
    if x.shape[1] == 1:
        x = x[:, 0]
    y = _RESPONSE_TRANSFORMS.get(name, lambda v: v)(y_raw)
    return Problem(
        name=name,
        model=MODELS[name],
        x=np.ascontiguousarray(x),
        y=np.ascontiguousarray(y),
        starts=[parsed["starts"][0], parsed["starts"][1]],
        certified=parsed["certified"],
        certified_sd=parsed["certified_sd"],
        certified_rss=parsed["certified_rss"],
        y_raw=y_raw,
        formula=parsed["formula"],
    )


def load_problems(directory=None):
    """All problems of `MODELS`, by name, in alphabetical order."""
    return {name: load_problem(name, directory) for name in sorted(MODELS)}


PROBLEMS = load_problems()


# --------------------------------------------------------------------------
# Helpers for tests and benchmarks
# --------------------------------------------------------------------------
def lre(estimate, certified):
    """Log relative error per parameter, the StRD figure of merit.

    LRE = -log10(|estimate - certified| / |certified|), or
    -log10(|estimate - certified|) where the certified value is 0; roughly the
    number of correct significant digits. Clipped to [0, 15] (an exact match
    gives 15; a NaN estimate gives 0).

    Args:
      estimate: array_like of shape (k,).
      certified: array_like of shape (k,).

    Returns:
      float64 array of shape (k,).
    """
    estimate = np.asarray(estimate, dtype=np.float64)
    certified = np.asarray(certified, dtype=np.float64)
    error = np.abs(estimate - certified)
    scale = np.where(certified == 0.0, 1.0, np.abs(certified))
    with np.errstate(divide="ignore", invalid="ignore"):
        value = -np.log10(error / scale)
    value = np.where(np.isnan(value), 0.0, value)
    return np.clip(value, 0.0, LRE_CAP)


def residual_fn_for(problem, variables):
    """A zero-argument callable returning the residual vector ``model - y``.

    Args:
      problem: a `Problem`.
      variables: one scalar float64 ``tf.Variable`` per parameter, in order.

    Returns:
      ``lambda: model(variables, x) - y`` with ``x`` and ``y`` float64 constants.

    Raises:
      ValueError: if the number of variables is not the problem's.
    """
    if len(variables) != len(problem.certified):
        raise ValueError(f"{problem.name} has {len(problem.certified)} parameters; "
                         f"received {len(variables)} variables")
    x = tf.constant(problem.x, dtype=tf.float64)
    y = tf.constant(problem.y, dtype=tf.float64)
    model = problem.model
    return lambda: model(variables, x) - y


def variables_at(values, name_prefix="b"):
    """Scalar float64 ``tf.Variable``s ``b1..bk`` initialised to ``values``."""
    return [tf.Variable(float(v), dtype=tf.float64, name=f"{name_prefix}{i + 1}")
            for i, v in enumerate(values)]


def rss_at(problem, params, xp=tf.math):
    """Residual sum of squares at ``params`` (TensorFlow or, with xp=numpy, numpy)."""
    if xp is np:
        r = problem.model(np.asarray(params, dtype=np.float64), problem.x, xp=np) - problem.y
        return float(np.sum(r * r))
    x = tf.constant(problem.x, dtype=tf.float64)
    b = tf.constant(np.asarray(params, dtype=np.float64))
    r = problem.model(tf.unstack(b), x) - problem.y
    return float(tf.reduce_sum(r * r))
