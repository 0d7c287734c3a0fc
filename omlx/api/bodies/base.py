"""What every request model shares: strict parsing, field types, and the 400 a mistake becomes.

`Body` is the base of every route's request model: strict types (``"1"`` is not an integer, ``1``
is not a string), JSON numbers finite, unknown fields ignored (the reference APIs grow fields
faster than omlx; clients such as Claude Code send ``context_management`` and ``output_config``).
`parse_body` parses the bytes once (pydantic-core's JSON parser, which also refuses invalid UTF-8,
lone UTF-16 surrogates and nesting deeper than 200) and validates them; every mistake becomes the
`InvalidRequestError` the tests assert: ``param`` is the dotted path of the field at fault
(``messages[3].content``) and the message names it and the problem, in the words `omlx.api.params`
used before (``'max_tokens' must be >= 1 (got 0)``).

A rule that spans fields (``top_logprobs`` needs ``logprobs``) is a model validator that raises
`rule` with the parameter to name; a choice between shapes (``stop``: a string or strings) is a
`shape` check with its own message and its JSON Schema, so the error never lists each union arm.
Must not: import sanic, touch a model or a tokenizer (rules that need one stay in the route).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable, Generic, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic_core import PydanticCustomError, from_json

from omlx.errors import InvalidRequestError, PayloadTooLargeError

B = TypeVar("B", bound="Body")


class Body(BaseModel):
    """Base of a request body (and of the objects inside one): strict, extra fields ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", frozen=True,
                              revalidate_instances="never", cache_strings="keys")


class Part(Body):
    """An object inside a body whose unknown keys are kept (a content block, a tool, an item)."""

    model_config = ConfigDict(extra="allow")


def rule(param: str, message: str) -> PydanticCustomError:
    """A rule across fields is broken: a 400 naming ``param`` (relative to the object checked;
    ``{param}`` in ``message`` becomes its whole path)."""
    return PydanticCustomError("rule", message, {"rule_param": param})


def _integral(v: Any) -> Any:
    # the old reader took 4.0 for 4; JSON has one number type
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]


def IntIn(ge: int | None = None, le: int | None = None) -> Any:
    """`Int` bounded to [``ge``, ``le``]: the bounds sit on the integer, inside the validator that
    takes 4.0 for 4, so its JSON Schema says ``minimum`` / ``maximum``. (``Int | None = Field(ge=1)``
    puts them outside it, where pydantic enforces them but writes ``ge`` / ``le`` into the schema,
    keywords no JSON Schema validator knows.)"""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


#: The most tokens a request may name (``max_tokens`` and its kin, a thinking budget): a signed
#: 32-bit integer, far beyond any context (what is asked is clamped to the model's context anyway);
#: a larger number (``99999999999999999999999``) is a client's mistake, a 400 naming the field.
MAX_TOKENS = 2**31 - 1
#: A number of tokens to generate: from 1 to `MAX_TOKENS`.
Tokens = IntIn(ge=1, le=MAX_TOKENS)

NonEmpty = Annotated[str, Field(min_length=1)]
Model = Annotated[str, Field(min_length=1, description="a served model id, alias or id:profile")]


def shape(problem: Callable[[Any], str | None], schema: dict[str, Any]) -> Any:
    """A field of ``Any`` type checked by ``problem`` (the value -> what is wrong with it, or None;
    ``{param}`` in the answer is filled in with the field's path) and documented by ``schema``.

    For choices between shapes (a string or an array): one message instead of one per arm.
    """
    def validate(v: Any) -> Any:
        msg = problem(v)
        if msg is not None:
            raise PydanticCustomError("shape", msg)
        return v
    return Annotated[Any, BeforeValidator(validate), WithJsonSchema(schema)]


# ---- errors -----------------------------------------------------------------------------------

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "tuple"}


def dotted(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 3, "content")`` -> ``messages[3].content``; the arms of a union that pydantic
    puts in ``loc`` (``str``, ``list[str]``, a tag such as ``Function``) are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part and (part[0].isupper() or part in _TYPE_TAGS or not part.replace("_", "a").isalnum()):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


_PHRASES = {  # pydantic-core error type -> the old reader's words ({p}: the field's path)
    "missing": "'{p}' is required",
    "string_type": "'{p}' must be a string", "string_sub_type": "'{p}' must be a string",
    "int_type": "'{p}' must be an integer", "int_parsing": "'{p}' must be an integer",
    "int_from_float": "'{p}' must be an integer",
    "float_type": "'{p}' must be a finite number", "float_parsing": "'{p}' must be a finite number",
    "finite_number": "'{p}' must be a finite number",
    "bool_type": "'{p}' must be a boolean",
    "list_type": "'{p}' must be an array",
    "dict_type": "'{p}' must be an object", "model_type": "'{p}' must be an object",
    "model_attributes_type": "'{p}' must be an object",
    "greater_than_equal": "'{p}' must be >= {ge} (got {value!r})", "greater_than": "'{p}' must be > {gt} (got {value!r})",
    "less_than_equal": "'{p}' must be <= {le} (got {value!r})", "less_than": "'{p}' must be < {lt} (got {value!r})",
    "string_too_short": "'{p}' must not be empty",
    "too_long": "'{p}' may hold at most {max_length} items",
    "literal_error": "'{p}' must be one of {expected}; got {value!r}", "enum": "'{p}' must be one of {expected}; got {value!r}",
    "string_pattern_mismatch": "'{p}' must match {pattern}",
}


def _phrase(kind: str, p: str, ctx: dict[str, Any], value: Any, message: str) -> str:
    if kind == "too_short":
        n = ctx.get("min_length")
        return f"'{p}' must not be empty" if n == 1 else f"'{p}' must hold at least {n} items"
    template = _PHRASES.get(kind)
    if template is None:
        return f"'{p}': {message}"
    try:
        return template.format(p=p, value=value, **ctx)
    except (KeyError, IndexError, ValueError):
        return f"'{p}': {message}"


def _json_error(message: str) -> InvalidRequestError:
    low = message.lower()
    if "surrogate" in low or "hex escape" in low:
        return InvalidRequestError("request body contains an unpaired Unicode surrogate (\\ud800-\\udfff), which is not valid text")
    if "recursion" in low:
        return InvalidRequestError("request body nests JSON too deeply")
    if "eof while parsing a value at line 1 column 0" in low:
        return InvalidRequestError("request body is empty; expected a JSON object")
    return InvalidRequestError(f"request body is not valid JSON: {message}")


def request_error(e: ValidationError) -> InvalidRequestError:
    """The first of ``e``'s errors as the 400 of omlx's error contract (see the module doc)."""
    err = e.errors(include_url=False)[0]
    kind, loc, ctx = err["type"], tuple(err["loc"]), err.get("ctx") or {}
    if kind == "json_invalid":
        return _json_error(str(ctx.get("error", err["msg"])))
    if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
        return InvalidRequestError(f"request body must be a JSON object, not {_json_kind(err.get('input'))}")
    base = dotted(loc) or ""
    if kind == "rule":
        p = ctx["rule_param"]
        base = f"{base}.{p}" if base and p else (base or p)
    if kind in ("rule", "shape"):
        return InvalidRequestError(err["msg"].replace("{param}", base), param=base or None)
    return InvalidRequestError(_phrase(kind, base, ctx, err.get("input"), err["msg"]), param=base or None)


def _json_kind(v: Any) -> str:
    """The JSON name of a parsed value's type (``null``, not ``NoneType``)."""
    return {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
            type(None): "null"}.get(type(v), type(v).__name__)


@dataclass(frozen=True, slots=True)
class Parsed(Generic[B]):
    """A body parsed once: ``data`` the JSON object as Python values (what the protocol's mapping
    reads: messages, blocks, tools, items), ``body`` the same validated by its model."""

    data: dict[str, Any]
    body: B


def parse_body(model: type[B], raw: bytes | None, max_bytes: int | None = None) -> Parsed[B]:
    """Parse and validate a request body, once (`Parsed`).

    Raises:
        PayloadTooLargeError: the body is larger than ``max_bytes``.
        InvalidRequestError: empty, not JSON, not an object, or a field at fault (names it).
    """
    if max_bytes is not None and raw is not None and len(raw) > max_bytes:
        raise PayloadTooLargeError(f"request body is {len(raw)} bytes; the limit is {max_bytes}")
    if not raw:
        raise InvalidRequestError("request body is empty; expected a JSON object")
    try:
        data = from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        raise _json_error(str(e)) from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"request body must be a JSON object, not {_json_kind(data)}")
    try:
        return Parsed(data, model.model_validate(data))
    except ValidationError as e:
        raise request_error(e) from None
