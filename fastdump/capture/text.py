"""Text for a record: an exception's or a value's, shortened, never raising.

A helper of the Dumper's modules (fastdump/capture/dumper.py); see docs/INTERNALS.md.
"""

from __future__ import annotations


def _short(exc: BaseException, limit: int = 200) -> str:
    """An exception's text for a record, shortened; never raises (a model's exception whose str()
    fails must still reach the caller as itself)."""
    try:
        text = str(exc)
    except Exception as inner:
        text = f"<its str() raised {type(inner).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _short_repr(value, limit: int = 80) -> str:
    """repr() of a value for a record, shortened; never raises."""
    try:
        text = repr(value)
    except Exception as inner:
        text = f"<{type(value).__name__} whose repr() raised {type(inner).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."
