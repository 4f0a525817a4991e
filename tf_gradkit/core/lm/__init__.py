"""Levenberg-Marquardt in pure TensorFlow: parts and the compiled step."""

from tf_gradkit.core.lm.damping import (Levenberg, Marquardt, MultiplyDivide, Nielsen,
                                        TrustRegion)
from tf_gradkit.core.lm.implicit import solve_least_squares
from tf_gradkit.core.lm.least_squares import LeastSquaresResult, least_squares
from tf_gradkit.core.lm.linear_solvers import QR, Cholesky, NormalEquationsDual
from tf_gradkit.core.lm.step import LMState, StepInfo, levenberg_marquardt_step

__all__ = [
    "Cholesky", "LMState", "LeastSquaresResult", "Levenberg", "Marquardt",
    "MultiplyDivide", "Nielsen", "NormalEquationsDual", "QR", "StepInfo",
    "TrustRegion",
    "least_squares", "levenberg_marquardt_step", "solve_least_squares",
]
