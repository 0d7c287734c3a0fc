"""Request models of the admin routes with a body: ``POST /v1/models/{id}/unload`` and
``POST /v1/admin/pulls``. Must not: import sanic or call the hub (a repo id is parsed in the route).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from omlx.api.bodies.base import Body, NonEmpty, rule

#: The keys ``POST /v1/admin/pulls`` reads.
PULL_KEYS = ("repo", "revision")


class UnloadRequest(Body):
    """Running requests get ``drain_s`` seconds to finish; the rest fail with a clear error."""

    drain_s: float = Field(30.0, ge=0.0, le=3600.0)


class PullRequest(Body):
    """A Hugging Face model repo to download into the hub cache (``omlx models pull``'s code). 409:
    that repo is already being pulled; 400: a malformed body. The pull itself may then fail with the
    status its error carries in GET /v1/admin/pulls/{id}: 404 no such repo or revision, 403 gated or
    not readable with HF_TOKEN, 422 not an mlx-lm model, 507 not enough disk, 502 the hub cannot be
    reached."""

    model_config = ConfigDict(json_schema_extra={"additionalProperties": False})

    repo: str = Field(description="ORG/NAME (ORG/NAME@REVISION is accepted too)",
                      json_schema_extra={"pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"})
    revision: NonEmpty | None = Field(None, description="a branch, tag or commit hash (default: main)",
                                      json_schema_extra={"pattern": r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"})

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        unknown = sorted(set(data) - set(PULL_KEYS)) if isinstance(data, dict) else []
        if unknown:
            raise rule(unknown[0], f"unknown field(s) {', '.join(map(repr, unknown))}; a pull takes 'repo' and "
                       "optionally 'revision'")
        return data
