"""Request models (omlx/api/bodies): a mistake is a 400 naming its dotted path, the combinations the
reference APIs refuse are refused, the lenient cases real clients need pass, the OpenAPI document's
request schemas are the models' own, and a body that fails validation is answered before the
model is leased or a template rendered (omlx/api/holds.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from omlx.api.bodies.admin import PullRequest, UnloadRequest
from omlx.api.bodies.anthropic import CountTokensRequest, MessagesRequest
from omlx.api.bodies.base import dotted, parse_body
from omlx.api.bodies.encoders import EmbeddingsRequest, RerankRequest
from omlx.api.bodies.openai import ChatCompletionRequest, CompletionRequest
from omlx.api.bodies.responses import ResponsesRequest
from omlx.api.bodies.schema import BODIES, REF, body_schemas
from omlx.api.openapi import openapi_document
from omlx.errors import InvalidRequestError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "client_requests"
HI = [{"role": "user", "content": "hi"}]


def _error(model, body) -> InvalidRequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(InvalidRequestError) as ei:
        parse_body(model, raw)
    return ei.value


def test_dotted_paths_leave_out_union_arms():
    assert dotted(("messages", 3, "content")) == "messages[3].content"
    assert dotted(("tools", 0, "Function", "name")) == "tools[0].name"
    assert dotted(("stop", "list[str]", 0)) == "stop[0]"
    assert dotted(()) is None


@pytest.mark.parametrize("patch,param,words", [
    ({"messages": HI + [{"role": "assistant", "content": None}]}, "messages[1].content", "null only for an assistant"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "a string or an array of parts"),
    ({"temperature": 2.5}, "temperature", "<= 2.0"),
    ({"max_tokens": 0}, "max_tokens", ">= 1 (got 0)"),
    ({"seed": "1"}, "seed", "must be an integer"),
    ({"seed": 2**80}, "seed", f"<= {2**63 - 1}"),  # was folded mod 2**64: the same draws as seed 0
    ({"seed": 2**63}, "seed", f"<= {2**63 - 1}"),  # was folded onto seed -2**63
    ({"seed": -(2**63) - 1}, "seed", f">= {-(2**63)}"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"top_logprobs": 2}, "top_logprobs", "requires 'logprobs'"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream' is true"),
    ({"n": 3}, "n", "one choice"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "'name' and 'schema'"),
])
def test_openai_chat_mistakes_name_their_path(patch, param, words):
    err = _error(ChatCompletionRequest, {"model": "m", "messages": HI, **patch})
    assert err.param == param and words in err.message, (err.param, err.message)


@pytest.mark.parametrize("seed", [-(2**63), -5, 0, 2**63 - 1])
@pytest.mark.parametrize("model,base", [(ChatCompletionRequest, {"messages": HI}), (CompletionRequest, {"prompt": "hi"}),
                                        (ResponsesRequest, {"input": "hi"})])
def test_every_signed_64_bit_seed_is_accepted(model, base, seed):
    """OpenAI's ``seed`` is a signed 64-bit integer (its API reference: -2**63 to 2**63 - 1)."""
    assert parse_body(model, json.dumps({"model": "m", **base, "seed": seed}).encode()).body.seed == seed


def test_a_seed_outside_64_bits_is_400_on_every_openai_route():
    for model, base in [(CompletionRequest, {"prompt": "hi"}), (ResponsesRequest, {"input": "hi"})]:
        err = _error(model, {"model": "m", **base, "seed": 2**64})
        assert err.param == "seed" and f"<= {2**63 - 1}" in err.message, (err.param, err.message)


@pytest.mark.parametrize("patch,param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive"}, "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "adaptive"}, "temperature": 0.2}, "temperature"),
    ({"thinking": {"type": "adaptive"}, "top_k": 5}, "top_k"),
    ({"thinking": {"type": "adaptive"}, "top_p": 0.5}, "top_p"),
    ({"tools": [{"name": "Bash"}]}, "tools[0].input_schema"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content"),
])
def test_anthropic_combinations_are_400_naming_the_parameter(patch, param):
    err = _error(MessagesRequest, {"model": "m", "max_tokens": 4096, "messages": HI, **patch})
    assert err.param == param, (err.param, err.message)


def test_what_real_clients_send_is_accepted():
    routes = {"/v1/messages/count_tokens": CountTokensRequest, "/v1/messages": MessagesRequest,
              "/v1/responses": ResponsesRequest, "/v1/chat/completions": ChatCompletionRequest}
    num_bodies = 0
    for path in sorted(FIXTURES.glob("*.json")):  # Claude Code, Codex (tool_choice "auto" without tools), the SDKs
        rec = json.loads(path.read_text())
        if rec["method"] != "POST":
            continue
        model = routes[rec["path"].split("?")[0]]
        parse_body(model, json.dumps(rec["body"]).encode())  # system messages, unknown blocks, server tools
        num_bodies += 1
    assert num_bodies >= 30, num_bodies


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "Bash"}])
@pytest.mark.parametrize("model", [MessagesRequest, CountTokensRequest])
def test_anthropic_tool_choice_forcing_a_call_without_tools_is_400(model, choice):
    for tools in ({}, {"tools": []}):
        err = _error(model, {"model": "m", "max_tokens": 16, "messages": HI, "tool_choice": choice, **tools})
        assert err.param == "tool_choice" and "needs 'tools'" in err.message, (err.param, err.message)


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "none"}])
def test_anthropic_tool_choice_forcing_nothing_is_fine_without_tools(choice):
    parse_body(MessagesRequest, json.dumps({"model": "m", "max_tokens": 16, "messages": HI, "tool_choice": choice}).encode())


@pytest.mark.parametrize("raw,words", [
    (b"", "empty"), (b"{", "not valid JSON"), (b"[]", "must be a JSON object, not an array"),
    (b"null", "must be a JSON object, not null"), (b'"x"', "not a string"), (b"5", "not a number"),
    (b"true", "not a boolean"),
    (b'{"messages": "\\ud800"}', "unpaired Unicode surrogate"), (b"[" * 100000, "too deeply"),
])
def test_malformed_bytes_are_400_without_a_param(raw, words):
    err = _error(ChatCompletionRequest, raw)
    assert err.param is None and words in err.message, err.message


def test_openapi_request_schemas_are_the_models_own():
    schemas = openapi_document()["components"]["schemas"]
    for model in BODIES:
        own = model.model_json_schema(ref_template=REF + "{model}")
        own.pop("$defs", None)
        assert schemas[model.__name__] == own, model.__name__


# ---- the JSON Schemas say what the models enforce ------------------------------------------------

_PROBE_INTS = sorted({*range(-3, 25), 1000, 1023, 1024, 1025, 3599, 3600, 3601, 2**31})
_PROBE_FLOATS = [-2.5, -2.01, -2.0, -1.0, -0.01, 0.0, 0.005, 0.01, 0.5, 0.95, 1.0, 1.01, 1.5, 2.0, 2.01, 2.5,
                 9.99, 10.0, 10.01, 3599.5, 3600.0, 3600.5]
_PROBED = [  # (model, a body it accepts, the path of the object whose numeric fields are probed)
    (ChatCompletionRequest, {"model": "m", "messages": HI, "logprobs": True}, ()),
    (CompletionRequest, {"model": "m", "prompt": "hi"}, ()),
    (MessagesRequest, {"model": "m", "max_tokens": 16, "messages": HI}, ()),
    (MessagesRequest, {"model": "m", "max_tokens": 2**31 - 1, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2048}},
     ("thinking",)),
    (CountTokensRequest, {"model": "m", "messages": HI}, ()),
    (ResponsesRequest, {"model": "m", "input": "hi"}, ()),
    (EmbeddingsRequest, {"model": "m", "input": "hi"}, ()),
    (RerankRequest, {"model": "m", "query": "q", "documents": ["d"]}, ()),
    (UnloadRequest, {}, ()),
    (PullRequest, {"repo": "org/name"}, ()),
]


def _numeric_kind(prop: dict) -> str | None:
    """"integer" / "number" for a property whose schema (or one of its anyOf arms) is one."""
    for arm in [prop, *prop.get("anyOf", ())]:
        if arm.get("type") in ("integer", "number"):
            return arm["type"]
    return None


def _component_at(schemas: dict, name: str, path: tuple[str, ...]) -> str:
    for key in path:
        prop = schemas[name]["properties"][key]
        ref = next(a["$ref"] for a in [prop, *prop.get("anyOf", ())] if "$ref" in a)
        name = ref.removeprefix(REF)
    return name


def test_every_numeric_bound_a_model_enforces_is_in_its_json_schema():
    """Each numeric field, set to values around every bound in use: the model refuses it exactly when
    its JSON Schema does (a bound written as pydantic's ``ge`` is ignored by schema validators)."""
    schemas = body_schemas()
    numeric = {(name, key) for name, s in schemas.items() for key, p in s.get("properties", {}).items() if _numeric_kind(p)}
    probed: set[tuple[str, str]] = set()
    wrong = []
    for model, base, path in _PROBED:
        parse_body(model, json.dumps(base).encode())
        name = _component_at(schemas, model.__name__, path)
        for key, prop in schemas[name].get("properties", {}).items():
            kind = _numeric_kind(prop)
            if kind is None:
                continue
            probed.add((name, key))
            schema_ok = jsonschema.Draft202012Validator(prop).is_valid
            for v in _PROBE_INTS + (_PROBE_FLOATS if kind == "number" else []):
                body = json.loads(json.dumps(base))
                obj = body
                for k in path:
                    obj = obj[k]
                obj[key] = v
                try:
                    parse_body(model, json.dumps(body).encode())
                    model_ok, param = True, None
                except InvalidRequestError as e:
                    model_ok, param = False, e.param
                if model_ok != schema_ok(v) or param not in (None, ".".join((*path, key))):
                    wrong.append((model.__name__, ".".join((*path, key)), v, "model", model_ok, param, "schema", schema_ok(v)))
    assert not wrong, wrong
    assert numeric <= probed, numeric - probed  # a new model with numbers needs a line in _PROBED


@pytest.mark.parametrize("message,ok", [
    ({"role": "user", "content": "hi"}, True), ({"role": "user"}, False), ({"role": "user", "content": None}, False),
    ({"role": "assistant", "content": None}, False), ({"role": "assistant"}, False),
    ({"role": "assistant", "tool_calls": []}, False), ({"role": "user", "tool_calls": [{"id": "1"}]}, False),
    ({"role": "assistant", "tool_calls": [{"id": "1"}]}, True), ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, True),
    ({"role": "tool", "content": "x", "tool_call_id": "1"}, True),
])
def test_chat_message_content_is_required_in_the_schema_as_in_the_model(message, ok):
    schema_ok = jsonschema.Draft202012Validator(body_schemas()["ChatMessage"]).is_valid(message)
    try:
        parse_body(ChatCompletionRequest, json.dumps({"model": "m", "messages": [message]}).encode())
        model_ok = True
    except InvalidRequestError:
        model_ok = False
    assert model_ok == schema_ok == ok, (model_ok, schema_ok)


# ---- validation before the lease and the render ------------------------------------------------


class _Tokenizer:
    chat_template = "{{ messages }}"
    has_chat_template = True

    def __init__(self) -> None:
        self.num_renders = 0

    def apply_chat_template(self, msgs, **kw):
        self.num_renders += 1
        return "prompt"

    def encode(self, text, add_special_tokens=False):
        return [1, 2, 3]

    def __len__(self) -> int:
        return 100


def _route_call(body: dict):
    from omlx.api import openai as openai_routes
    from omlx.api.app import create_app
    from omlx.config import ModelSettings, ServerConfig
    from omlx.errors import RateLimitError
    from omlx.pool import ModelLease, PoolEntry

    tok = _Tokenizer()
    submitted: list = []

    class Engine:
        supports_constraints = False

        def submit(self, request, sink):
            submitted.append(request)
            raise RateLimitError("test: not generating")

    entry = PoolEntry(SimpleNamespace(model_id="m", tokenizer=tok, context_length=1000, template_reads_tools=True), Engine(),
                      settings=ModelSettings())

    class Pool:
        num_leases = 0

        async def acquire_async(self, model, *, task=None, owner="", then=None):
            Pool.num_leases += 1
            return ModelLease("m", 1, entry, owner)

        def release(self, lease):
            pass

    app = create_app(ServerConfig(), None, {}, name=f"omlx_bodies_test_{id(tok)}")  # no pool for /metrics to read
    app.ctx.pool = Pool()
    http = SimpleNamespace(app=app, body=json.dumps(body).encode(), ctx=SimpleNamespace(), method="POST",
                           path="/v1/chat/completions", headers={}, transport=None)
    try:
        asyncio.run(openai_routes.chat_completions(http))
    except (InvalidRequestError, RateLimitError) as e:
        return e, Pool.num_leases, tok.num_renders, submitted
    raise AssertionError("the route answered")


def test_a_bad_temperature_is_400_before_the_lease_and_the_render():
    err, num_leases, num_renders, submitted = _route_call({"model": "m", "messages": HI, "temperature": 7})
    assert isinstance(err, InvalidRequestError) and err.param == "temperature"
    assert (num_leases, num_renders, submitted) == (0, 0, [])
    # the same body with a good temperature: one lease, one render, submitted once
    err, num_leases, num_renders, submitted = _route_call({"model": "m", "messages": HI, "temperature": 0.7})
    assert not isinstance(err, InvalidRequestError), err
    assert (num_leases, num_renders, len(submitted)) == (1, 1, 1)
    assert submitted[0].sampling.temperature == 0.7
