"""Reading and validating JSON request bodies: every mistake names its parameter.

All functions raise InvalidRequestError (HTTP 400) with ``param`` set; they never let a
TypeError or KeyError escape as a 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from omlx.errors import InvalidRequestError, PayloadTooLargeError

_MISSING = object()


def parse_json_object(body: bytes | None, max_bytes: int | None = None) -> dict[str, Any]:
    """Parse a request body that must be a JSON object.

    Raises:
        PayloadTooLargeError: the body is larger than ``max_bytes``.
        InvalidRequestError: empty, not JSON, or not an object.
    """
    if max_bytes is not None and body is not None and len(body) > max_bytes:
        raise PayloadTooLargeError(f"request body is {len(body)} bytes; the limit is {max_bytes}")
    if not body:
        raise InvalidRequestError("request body is empty; expected a JSON object")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"request body is not valid JSON: {e}") from e
    except RecursionError:
        raise InvalidRequestError("request body nests JSON too deeply") from None
    try:  # JSON may carry lone UTF-16 surrogates ("\\ud800"), which are not text
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("request body contains an unpaired Unicode surrogate (\\ud800-\\udfff), which is not valid text") from None
    except RecursionError:
        raise InvalidRequestError("request body nests JSON too deeply") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"request body must be a JSON object, not {type(data).__name__}")
    return data


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


def get_str(body: dict[str, Any], name: str, default: Any = _MISSING, *, allow_empty: bool = False) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise InvalidRequestError(f"'{name}' is required", param=name)
        return default
    if not isinstance(v, str):
        raise InvalidRequestError(f"'{name}' must be a string", param=name)
    if not v and not allow_empty:
        raise InvalidRequestError(f"'{name}' must not be empty", param=name)
    return v


def get_bool(body: dict[str, Any], name: str, default: bool | None = False) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequestError(f"'{name}' must be a boolean", param=name)
    return v


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


def get_float(body: dict[str, Any], name: str, default: Any = None, *, lo: float | None = None, hi: float | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidRequestError(f"'{name}' must be a finite number", param=name)
    if lo is not None and v < lo:
        raise InvalidRequestError(f"'{name}' must be >= {lo} (got {v})", param=name)
    if hi is not None and v > hi:
        raise InvalidRequestError(f"'{name}' must be <= {hi} (got {v})", param=name)
    return float(v)


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


def get_stop(body: dict[str, Any], name: str = "stop", max_items: int = 16) -> tuple[str, ...]:
    """``stop``: a string or a list of strings (OpenAI allows up to 4; we allow ``max_items``)."""
    v = body.get(name)
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise InvalidRequestError(f"'{name}' must be a string or an array of strings", param=name)
    if len(v) > max_items:
        raise InvalidRequestError(f"'{name}' may hold at most {max_items} strings", param=name)
    return tuple(s for s in v if s)


def get_logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidRequestError("'logit_bias' must be an object of token id -> bias", param="logit_bias")
    out = []
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"'logit_bias' key {k!r} is not a token id", param="logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise InvalidRequestError(f"'logit_bias' token id {tid} is outside the vocabulary (0..{vocab_size - 1})", param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise InvalidRequestError("'logit_bias' values must be numbers in [-100, 100]", param="logit_bias")
        out.append((tid, float(b)))
    return tuple(out)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""OpenAI's ``reasoning_effort`` / ``reasoning.effort`` values (API reference, 2026)."""


def get_effort(value: Any, param: str) -> str | None:
    """A reasoning effort: None (absent) or one of ``REASONING_EFFORTS``.

    Raises:
        InvalidRequestError: any other value (names ``param``).
    """
    if value is None:
        return None
    if value not in REASONING_EFFORTS:
        raise InvalidRequestError(f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}; got {value!r}", param=param)
    return value
