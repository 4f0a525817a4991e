"""The optimizer tree: what an optimizer wraps (``inner_optimizer``) or
dispatches variable groups to (``optimizers``: Keras 3.15's
``MultiOptimizer``), walked the same way for every flavour. What a
dispatcher keeps privately (its map, its variables) is read through the host
of its flavour (`tf_gradkit._hosts.host_of`)."""

import re


def _host_call(optimizer, hook, default):
    """``host.<hook>(optimizer)`` for the host serving ``optimizer``, or
    ``default`` when no host serves it."""
    from tf_gradkit import _hosts  # noqa: PLC0415  (the hosts import this module)

    host = _hosts.host_of(optimizer)
    return default if host is None else getattr(host, hook)(optimizer)


def sub_optimizers(optimizer):
    """The optimizers ``optimizer`` hands work to: the one it wraps
    (``inner_optimizer``: our wrappers, Keras's LossScaleOptimizer) or the
    ones it dispatches variable groups to (``optimizers``: Keras 3.15's
    ``MultiOptimizer``, whose list is complete once it is built)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return [inner]
    group = getattr(optimizer, "optimizers", None)
    return list(group) if isinstance(group, (list, tuple)) else []


def declared_groups(optimizer):
    """``[(key, optimizer)]``: the optimizers a dispatcher's map names
    (Keras 3.15's ``MultiOptimizer(OptimizerMap)``: one per key, then the
    default under ``None``; a mapping with ``values()``: its values), whether
    or not a variable was given to them. Empty for a function or a
    non-dispatcher."""
    mapping = _host_call(optimizer, "optimizer_map", None)
    if mapping is None or not isinstance(getattr(optimizer, "optimizers", None),
                                         (list, tuple)):
        return []
    if hasattr(mapping, "default_optimizer"):  # OptimizerMap: keys, then the default
        return [(key, mapping[key]) for key in mapping] + [
            (None, mapping.default_optimizer)]
    if hasattr(mapping, "values") and hasattr(mapping, "keys"):
        return [(key, mapping[key]) for key in mapping.keys()]
    return []


def check_groups(root):
    """Refuses, once every dispatcher below ``root`` (included) is built, an
    optimizer a map names that was given no variable: Keras's
    ``OptimizerMap`` matches a key against the whole variable path
    (``re.fullmatch``), so ``"encoder/"`` matches nothing and that group's
    variables go to the default optimizer, every micro-batch, in silence.
    The message suggests a key computed from the variables' paths
    (`suggested_key`), checked to match exactly the variables the key
    names somewhere in their path."""
    for dispatcher in optimizer_chain(root):
        if not getattr(dispatcher, "built", False):
            continue
        given = [o for o in sub_optimizers(dispatcher) if getattr(o, "built", False)]
        for key, sub in declared_groups(dispatcher):
            if key is None or any(sub is o for o in given):
                continue  # a default without variables is not a mistake
            paths = [getattr(v, "path", None) or v.name
                     for v in _host_call(dispatcher, "built_variables", [])]
            taken = [p for p in paths if any(
                other is not None and other != key and _fullmatch(other, p)
                for other, _ in declared_groups(dispatcher))]
            raise ValueError(
                f"{type(dispatcher).__name__}: the key {key!r} of its OptimizerMap "
                f"matched no variable, so its {type(sub).__name__} would never run "
                "and those variables would go to the default optimizer. Keys are "
                "matched against each variable's whole path (re.fullmatch). "
                + _key_advice(key, paths, taken))


def _fullmatch(key, path):
    """Whether Keras 3.15's ``OptimizerMap`` gives ``path`` to ``key``."""
    try:
        return key == path or re.fullmatch(key, path) is not None
    except (re.error, TypeError):
        return False


def _searched(key, paths):
    """The paths in which ``key`` is found (``re.search``; a key that is not
    a valid pattern, as plain text)."""
    try:
        pattern = re.compile(key)
    except (re.error, TypeError):
        return [p for p in paths if str(key) in p]
    return [p for p in paths if pattern.search(p)]


def suggested_key(key, paths, taken=()):
    """A key for Keras 3.15's ``OptimizerMap`` that selects (``re.fullmatch``,
    as the map matches) exactly the ``paths`` in which ``key`` is found
    (``re.search``), or None when it is found in none. The first of these
    that selects exactly those paths: the last layer of their common layer
    path under any path (``(.*/)?dense/.*``: it still matches after a model
    loaded from a ``.keras`` file lost its name from the paths); that common
    path followed by ``/.*``; the escaped paths as alternatives. Paths in ``taken`` (another key's) are left out:
    a path two keys match is refused by Keras."""
    targets = _searched(key, [p for p in paths if p not in set(taken)])
    if not targets:
        return None
    wanted = set(targets)
    common = []  # the layer path (all but the variable's name) they share
    for column in zip(*[p.split("/")[:-1] for p in targets]):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    candidates = []
    if common:
        candidates += ["(.*/)?" + re.escape(common[-1]) + "/.*",
                       re.escape("/".join(common)) + "/.*"]
    candidates.append("|".join(re.escape(p) for p in sorted(wanted)))
    for candidate in candidates:
        if {p for p in paths if re.fullmatch(candidate, p)} == wanted:
            return candidate
    return None  # not reached: the alternation selects exactly ``wanted``


def _key_advice(key, paths, taken=()):
    """What to write instead of ``key``, computed from the variables' paths."""
    suggestion = suggested_key(key, paths, taken)
    if suggestion is None:
        return (f"{key!r} is found in no variable's path left to the default "
                f"either; the paths are {paths}.")
    found = _searched(key, [p for p in paths if p not in set(taken)])
    return (f"Write {suggestion!r}: it matches exactly the variables whose path "
            f"contains {key!r}, {found} (the paths are {paths}).")


def _groups_unknown(optimizer):
    """A dispatcher (``optimizers``) not built yet: its list may grow."""
    return isinstance(getattr(optimizer, "optimizers", None), (list, tuple)) and not \
        getattr(optimizer, "built", True)


def dispatches(optimizer):
    """Whether ``optimizer`` gives each of its sub-optimizers only a group of
    the variables (``MultiOptimizer``), rather than wrapping one."""
    return getattr(optimizer, "inner_optimizer", None) is None and bool(
        sub_optimizers(optimizer))


def optimizer_chain(optimizer):
    """``optimizer`` and every optimizer below it (wrapped or dispatched to),
    outermost first, depth first, each once."""
    chain = []
    stack = [] if optimizer is None else [optimizer]
    while stack:
        current = stack.pop()
        if any(current is o for o in chain):
            continue
        chain.append(current)
        stack.extend(reversed(sub_optimizers(current)))
    return chain


def path_to(root, optimizer):
    """The optimizers from ``root`` down to ``optimizer`` (both included), or
    None when ``optimizer`` is not below ``root``."""
    if root is optimizer:
        return [root]
    for sub in sub_optimizers(root):
        below = path_to(sub, optimizer)
        if below is not None:
            return [root] + below
    return None
