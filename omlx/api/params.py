"""Reading fields of already-parsed JSON (query arguments, mapped blocks) by hand: every mistake
names its parameter. Request bodies are parsed and validated by their models (`omlx.api.bodies`);
what is left here serves the dashboard's query (`get_int`), the Anthropic mapping's direct callers
(`get_list`) and a body's model name read without validating it (`requested_model`).

All functions raise InvalidRequestError (HTTP 400) with ``param`` set; they never let a
TypeError or KeyError escape as a 500.
"""

from __future__ import annotations

import json
from typing import Any

from omlx.errors import InvalidRequestError

_MISSING = object()


def requested_model(body: bytes | None, max_bytes: int | None = None) -> str | None:
    """The ``model`` a request body names, or None (no body, too large, not JSON, not an object,
    no non-empty string ``model``: the route then reports the body in its own words). Never raises."""
    if not body or (max_bytes is not None and len(body) > max_bytes):
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


def get_int(body: dict[str, Any], name: str, default: Any = None, *, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise InvalidRequestError(f"'{name}' must be an integer", param=name)
    if lo is not None and v < lo:
        raise InvalidRequestError(f"'{name}' must be >= {lo} (got {v})", param=name)
    if hi is not None and v > hi:
        raise InvalidRequestError(f"'{name}' must be <= {hi} (got {v})", param=name)
    return v


def get_list(body: dict[str, Any], name: str, default: Any = _MISSING, *, non_empty: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        if default is _MISSING:
            raise InvalidRequestError(f"'{name}' is required", param=name)
        return default
    if not isinstance(v, list):
        raise InvalidRequestError(f"'{name}' must be an array", param=name)
    if non_empty and not v:
        raise InvalidRequestError(f"'{name}' must not be empty", param=name)
    return v
