"""Levenberg-Marquardt in pure TensorFlow: parts and the compiled step."""

from tf_gradkit.core.lm.damping import (Controller, Levenberg, LevenbergThenMarquardt,
                                        Marquardt, MultiplyDivide, Nielsen,
                                        RestartPolicy, Scaling, TrustRegion)
from tf_gradkit.core.lm.implicit import solve_least_squares
from tf_gradkit.core.lm.least_squares import LeastSquaresResult, least_squares
from tf_gradkit.core.lm.linear_solvers import QR, Cholesky, NormalEquationsDual, Solver
from tf_gradkit.core.lm.solve_cache import SolveCache
from tf_gradkit.core.lm.step import LMState, StepInfo, levenberg_marquardt_step
from tf_gradkit.core.lm.whole_solve import StopReason

__all__ = [
    "Cholesky", "Controller", "LMState", "LeastSquaresResult", "Levenberg",
    "LevenbergThenMarquardt", "Marquardt", "MultiplyDivide", "Nielsen",
    "NormalEquationsDual", "QR", "RestartPolicy", "Scaling", "Solver", "SolveCache",
    "StepInfo", "StopReason", "TrustRegion",
    "least_squares", "levenberg_marquardt_step", "solve_least_squares",
]
