"""The request models' JSON Schemas as OpenAPI 3.1 components (``#/components/schemas/<Name>``).

Each route body model is a component under its class name; the models inside them (messages,
tools, ...) are components too, referenced the same way. Must not: import sanic.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic.json_schema import models_json_schema

from omlx.api.bodies.admin import PullRequest, UnloadRequest
from omlx.api.bodies.anthropic import CountTokensRequest, MessagesRequest
from omlx.api.bodies.encoders import EmbeddingsRequest, RerankRequest
from omlx.api.bodies.openai import ChatCompletionRequest, CompletionRequest
from omlx.api.bodies.responses import ResponsesRequest

REF = "#/components/schemas/"

BODIES = (ChatCompletionRequest, CompletionRequest, MessagesRequest, CountTokensRequest, ResponsesRequest,
          EmbeddingsRequest, RerankRequest, UnloadRequest, PullRequest)
"""Every route body model (`omlx.api.openapi` names each in its operation's requestBody)."""


@functools.cache
def _components() -> dict[str, Any]:
    _, top = models_json_schema([(m, "validation") for m in BODIES], ref_template=REF + "{model}")
    return top["$defs"]


def body_schemas() -> dict[str, Any]:
    """``{name: JSON Schema}`` of every body model and the models inside them (a fresh dict)."""
    import copy

    return copy.deepcopy(_components())
