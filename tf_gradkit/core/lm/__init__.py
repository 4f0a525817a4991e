"""Levenberg-Marquardt in pure TensorFlow: parts and the compiled step."""

from tf_gradkit.core.lm.damping import Levenberg, Marquardt, MultiplyDivide, Nielsen
from tf_gradkit.core.lm.solve import LeastSquaresResult, least_squares
from tf_gradkit.core.lm.solvers import QR, Cholesky, NormalEquationsDual
from tf_gradkit.core.lm.step import LMState, StepInfo, levenberg_marquardt_step

__all__ = [
    "Cholesky", "LMState", "LeastSquaresResult", "Levenberg", "Marquardt",
    "MultiplyDivide", "Nielsen", "NormalEquationsDual", "QR", "StepInfo",
    "least_squares", "levenberg_marquardt_step",
]
