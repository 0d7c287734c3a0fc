"""Request models (omlx/api/bodies): a mistake is a 400 naming its dotted path, the combinations the
reference APIs refuse are refused, the lenient cases real clients need pass, the OpenAPI document's
request schemas are the models' own, and a body that fails validation is answered before the
model is leased or a template rendered (omlx/api/holds.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from omlx.api.bodies.anthropic import CountTokensRequest, MessagesRequest
from omlx.api.bodies.base import dotted, parse_body
from omlx.api.bodies.openai import ChatCompletionRequest
from omlx.api.bodies.responses import ResponsesRequest
from omlx.api.bodies.schema import BODIES, REF
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
    for path in sorted(FIXTURES.glob("claude_code__*.json")):
        rec = json.loads(path.read_text())
        if rec["method"] != "POST":
            continue
        model = CountTokensRequest if rec["path"].startswith("/v1/messages/count_tokens") else MessagesRequest
        parse_body(model, json.dumps(rec["body"]).encode())  # system messages, unknown blocks, server tools
    for path in sorted(FIXTURES.glob("codex__responses_stream_*.json")):
        parse_body(ResponsesRequest, json.dumps(json.loads(path.read_text())["body"]).encode())  # web_search, namespace


@pytest.mark.parametrize("raw,words", [
    (b"", "empty"), (b"{", "not valid JSON"), (b"[]", "must be a JSON object, not list"),
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

    entry = PoolEntry(SimpleNamespace(model_id="m", tokenizer=tok, context_length=1000), Engine(), settings=ModelSettings())

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
