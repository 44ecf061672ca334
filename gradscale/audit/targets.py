"""The audit's targets: a built-in's name (a framework adapter, a zoo bug or fix) or the user's module:function,
resolved to the step function."""

from __future__ import annotations

from collections.abc import Callable

from gradscale.audit.contract import AuditError, import_callable


def builtin_targets() -> dict[str, tuple[str, str]]:
    """name -> (module:function, one-line summary): the zoo and the framework adapters."""
    from gradscale.audit import adapters, zoo

    fixes: dict[str, list[str]] = {}
    for e in zoo.ZOO:
        fixes.setdefault(e.fixed, []).append(e.name)
    bugs = {e.name: (f"gradscale.audit.zoo:{e.name}", f"zoo: {e.summary}") for e in zoo.ZOO}
    fixed = {fix: (f"gradscale.audit.zoo:{fix}", f"zoo, the fix of: {', '.join(names)}")
             for fix, names in fixes.items()}
    return {**{name: (a.target, a.summary) for name, a in adapters.all_adapters().items()}, **bugs, **fixed}


def resolve_target(spec: str) -> Callable:
    """A built-in target's name or `module:function`, as the callable step (AuditError, one line, if not)."""
    from gradscale.audit.adapters import ADAPTERS, find_peer

    builtins = builtin_targets()
    if spec in ADAPTERS and ADAPTERS[spec].requires:
        find_peer(ADAPTERS[spec].requires, ADAPTERS[spec].peers, ADAPTERS[spec].install)
    path = builtins[spec][0] if spec in builtins else spec
    if ":" not in path:
        raise AuditError(f"error: target {spec!r} is neither a built-in target ({', '.join(sorted(builtins))}) "
                         "nor module:function")
    module_name, _, function_name = path.partition(":")
    return import_callable(module_name, function_name, f"target {spec!r}")
