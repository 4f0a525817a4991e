"""LM parts by name: the registries' names, saving a part as its name plus
``get_config``, and building a part back from a name, a saved dict or an
object (the one way both `least_squares` and the Keras optimizer read their
``controller``, ``scaling`` and ``solver`` arguments)."""

from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib


def part_name(part):
    """The name a part is known by (its table name, else its class name)."""
    for table in (damping_lib.CONTROLLERS, damping_lib.SCALINGS, solvers_lib.SOLVERS):
        for name, cls in table.items():
            if type(part) is cls:
                return name
    return type(part).__name__


def serialize_part(part):
    """``{"name": ..., "config": ...}``: what `resolve_part` rebuilds."""
    get_config = getattr(part, "get_config", None)
    return {"name": part_name(part), "config": dict(get_config()) if get_config else {}}


def resolve_part(value, table, argument):
    """A part object from an object, its name in ``table``, or its
    `serialize_part` dict (parameters included)."""
    config = {}
    if isinstance(value, dict) and "name" in value:
        value, config = value["name"], dict(value.get("config") or {})
    if isinstance(value, str):
        cls = table.get(value)
        if cls is None:
            raise ValueError(f"`{argument}` must be one of {sorted(table)} or an "
                             f"object. Received: {argument}={value!r}")
        return cls(**config)
    return value


def check_parts(scaling, solver, owner):
    """Refuses a scaling that needs ``diag(J^T J)`` with a solver that never
    forms it (its ``consumes`` is matrix-free)."""
    if solver.consumes not in solvers_lib.FORMS:
        raise ValueError(f"{owner}: a linear solver's `consumes` must be one of "
                         f"{solvers_lib.FORMS}. Received: solver="
                         f"{part_name(solver)!r} with consumes={solver.consumes!r}")
    if solver.consumes == solvers_lib.MATRIX_FREE and getattr(
            scaling, "needs_diagonal", True):
        raise ValueError(
            f"{owner}: solver={part_name(solver)!r} is matrix-free and never "
            "forms diag(J^T J), which scaling="
            f"{part_name(scaling)!r} uses, so it needs scaling='levenberg'.")
