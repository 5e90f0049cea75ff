"""Small helpers the config modules share (no imports beyond the standard library)."""

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
