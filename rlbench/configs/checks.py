"""Small helpers the config modules share (no imports beyond the standard library), and the one loader of
`"module.path:function"` settings (rewards, tools, generate functions) that the components call."""

from __future__ import annotations


def did_you_mean(name: str, choices) -> str:
    """" (did you mean 'x'?)" for the closest of `choices`, or ''."""
    import difflib

    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def is_import_path(value: str) -> bool:
    """Whether `value` reads as `"module.path:attribute"` (syntax only; nothing is imported)."""
    module_name, sep, attr = value.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module_name.split(".")) and attr.isidentifier()


def import_callable(path: str, where: str):
    """The callable `"module.path:attribute"` names, imported now. `where` prefixes the errors (the setting it came
    from): a module that does not import (ValueError naming the module and the exception), or one without that
    callable (with "did you mean" from the module's callables)."""
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"{where}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); check the "
                         "module is on PYTHONPATH (or installed) and imports cleanly") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        raise ValueError(f"{where}: module {module_name!r} has no callable {attr!r}{did_you_mean(attr, names)}")
    return fn
