"""LM's parts and stop reasons as named, documented types (issue 29 item 5).

No solve runs here: the stop codes keep their numbers and texts, every
registered part derives from its documented base, and the hybrid restart is
a restart policy that keeps its old name.
"""

import pytest

from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib
from tf_gradkit.core.lm import parts as parts_lib
from tf_gradkit.core.lm.least_squares import REASONS
from tf_gradkit.core.lm.whole_solve import StopReason

pytestmark = pytest.mark.keras_free

# The texts and codes `least_squares` returned before the enum existed.
OLD_REASONS = (
    "running", "gradient tolerance", "step tolerance", "cost tolerance",
    "iteration limit", "no acceptable step (damping exhausted)",
    "stalled far from a minimum (steps stopped while the gradient is not "
    "small: try another start or rescale the parameters)",
    "non-finite start (the parameters or the residuals at the start are "
    "inf or NaN)")


def test_stop_reasons_keep_their_codes_and_texts():
    # 6's text changed (issue 38): it names the tolerances and the rule;
    # it still starts with "stalled".
    assert REASONS[:6] + REASONS[7:] == OLD_REASONS[:6] + OLD_REASONS[7:]
    assert REASONS[6].startswith("stalled: xtol or ftol")
    assert [int(r) for r in StopReason] == list(range(8))
    assert [r.description for r in StopReason] == list(REASONS)
    assert StopReason.NON_FINITE_START == 7 and StopReason(4).name == "ITERATION_LIMIT"
    assert [r for r in StopReason if r.converged] == [
        StopReason.GRADIENT_TOLERANCE, StopReason.STEP_TOLERANCE,
        StopReason.COST_TOLERANCE]


def test_registered_parts_derive_from_their_bases():
    for cls in damping_lib.CONTROLLERS.values():
        assert issubclass(cls, damping_lib.Controller), cls
    for name, cls in damping_lib.SCALINGS.items():
        base = damping_lib.RestartPolicy if name == "hybrid" else damping_lib.Scaling
        assert issubclass(cls, base), cls
    assert issubclass(damping_lib.XScale, damping_lib.Scaling)
    for cls in solvers_lib.SOLVERS.values():
        assert issubclass(cls, solvers_lib.Solver), cls
    for base, method, args in ((damping_lib.Controller(), "propose", (None,) * 5),
                               (damping_lib.Scaling(), "diagonal", (None, None)),
                               (solvers_lib.Solver(), "solve", (None,) * 3),
                               (damping_lib.RestartPolicy(), "phases", (None,))):
        with pytest.raises(NotImplementedError):
            getattr(base, method)(*args)


def test_hybrid_is_a_restart_policy_under_its_old_names():
    assert damping_lib.Hybrid is damping_lib.LevenbergThenMarquardt
    policy = parts_lib.resolve_part("hybrid", damping_lib.SCALINGS, "scaling")
    assert isinstance(policy, damping_lib.RestartPolicy)
    assert not isinstance(policy, damping_lib.Scaling)
    assert parts_lib.part_name(policy) == "hybrid"
    assert parts_lib.serialize_part(damping_lib.Hybrid(factor=2.0)) == {
        "name": "hybrid", "config": {"factor": 2.0}}


def test_part_names_are_the_table_names_only():
    assert isinstance(parts_lib.resolve_part("dual", solvers_lib.SOLVERS, "solver"),
                      solvers_lib.NormalEquationsDual)
    with pytest.raises(ValueError, match=r"`solver` must be one of \['auto', 'cg', 'cholesky', "
                                         r"'dual', 'qr'\] or an object\. Received: "
                                         r"solver='normalequationsdual'"):
        parts_lib.resolve_part("normalequationsdual", solvers_lib.SOLVERS, "solver")
