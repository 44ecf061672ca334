"""The audit's targets: a built-in's name (a framework adapter, a zoo bug or fix) or the user's module:function,
resolved to the step function."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from gradscale.audit.contract import AuditError


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
        find_peer(ADAPTERS[spec].requires, ADAPTERS[spec].peers)
    path = builtins[spec][0] if spec in builtins else spec
    if ":" not in path:
        raise AuditError(f"error: target {spec!r} is neither a built-in target ({', '.join(sorted(builtins))}) "
                         "nor module:function")
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error (a SyntaxError) while importing it
        raise AuditError(f"error: target {spec!r}: cannot import {module_name!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    step = getattr(module, function_name, None)
    if not callable(step):
        raise AuditError(f"error: target {spec!r}: {module_name!r} has no function {function_name!r}")
    return step
