"""The one OmlxError tree.

Each class knows its HTTP status and how it looks in both API error shapes. The API layer
maps exceptions to responses in one place (`omlx.api.errors`); nothing else builds error JSON.

    OmlxError (500, api_error)
    ├── InvalidRequestError (400)        a client's mistake: names the parameter
    │   ├── ContextLengthError (400)     prompt + max_tokens > the model's context
    │   └── PayloadTooLargeError (413)
    ├── AuthenticationError (401)
    ├── NotFoundError (404)
    │   └── ModelNotFoundError (404, code model_not_found)
    ├── RateLimitError (429)             queue full: carries retry_after_s
    ├── OverloadedError (529)
    ├── ConflictError (409)              the thing asked for is already under way (a pull of that repo)
    ├── InsufficientMemoryError (507)    a model that cannot fit: carries the numbers
    ├── ModelImportError (500)           a model file or folder that cannot be imported
    │   ├── HubNotFoundError (404)       no such repo or revision on the Hugging Face hub
    │   ├── HubAccessError (403)         a gated or private repo the token (HF_TOKEN) may not read
    │   ├── NotAModelError (422)         a repo that is not an mlx-lm model omlx can serve
    │   ├── InsufficientDiskError (507)  not enough free disk for a download
    │   └── HubUnreachableError (502)    the hub cannot be reached, or a download broke off
    ├── ConfigError (500)                a config mistake (file, variable, flag): the server refuses to start
    │   └── config._Bad                  a check across keys, inside pydantic's validation (a ValueError)
    ├── ClusterError (500)               cluster control plane; the agent reports it, never an HTTP answer
    │   ├── PlanError                    the model does not fit the nodes' caps (carries shortfall_bytes)
    │   └── ControlError                 the control channel: connection lost, timeout, bad message
    │       └── AuthError                the handshake: a side without the shared secret
    ├── ClusterUnavailableError (503)    a pipeline peer is lost or frozen; the workers must restart
    ├── EngineError (500)                generation failed for this request only
    │   └── engine.faults.InjectedFault  TEST ONLY (OMLX_TEST_FAULT)
    ├── cache.blockfile.BadBlockError    a block file that is unreadable or not the block asked for
    │   └── OldFormatError               written by another format version (deleted, counted apart)
    ├── engine.cache_spec.UnsupportedCacheError   a cache class that cannot be cut into blocks
    ├── engine.cache_spec.NotHeldError   tokens that fell out of a window layer's cache
    ├── kernels.kv_blocks.KernelUnavailable       a native kernel whose source is missing
    ├── engine.pulls.PullCancelled       stops a cancelled pull's download from its byte callback
    ├── api.cluster_front._PipelineLeft  a streaming request's pipeline lost a node
    ├── cli.service_backends.ServiceError         a service command that cannot do what was asked
    └── bench.session.BenchError         a benchmark that cannot start (exit code 2)

The classes named with a module live there (they are that module's business); BadBlockError,
UnsupportedCacheError and NotHeldError are also ValueErrors and KernelUnavailable a
RuntimeError, as callers may catch them so. The rest live here. Outside the
tree only ``tool_parsers/gemma.py``'s private ``_Incomplete`` and ``_Invalid``: signals within
one parse that never leave it, in a module that imports only ``omlx.request`` and its own
package (STYLE.md habit 9). ``tests/unit/test_error_tree.py`` keeps this drawing true.
"""

from __future__ import annotations

from typing import Any


class OmlxError(Exception):
    """Base of every error omlx raises on purpose.

    Attributes:
        status: HTTP status code.
        openai_type: ``error.type`` in OpenAI's shape.
        anthropic_type: ``error.type`` in Anthropic's shape.
        param: the request parameter at fault, or None.
        code: OpenAI's ``error.code``, or None.
    """

    status = 500
    openai_type = "server_error"
    anthropic_type = "api_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def openai_body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, Errors)."""
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """``{"type": "error", "error": {"type", "message"}}`` (Anthropic API reference, Errors)."""
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def headers(self) -> dict[str, str]:
        """Extra response headers (e.g. ``retry-after``)."""
        return {}


class InvalidRequestError(OmlxError):
    status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class PayloadTooLargeError(InvalidRequestError):
    status = 413
    anthropic_type = "request_too_large"


class AuthenticationError(OmlxError):
    status = 401
    openai_type = "authentication_error"
    anthropic_type = "authentication_error"
    code = "invalid_api_key"


class NotFoundError(OmlxError):
    status = 404
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"

    def __init__(self, model: str, *, hint: str = ""):
        super().__init__(f"The model '{model}' does not exist" + (f": {hint}" if hint else ""), param="model")
        self.model = model


class RateLimitError(OmlxError):
    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)}


class OverloadedError(OmlxError):
    status = 529
    openai_type = "server_error"
    anthropic_type = "overloaded_error"


class InsufficientMemoryError(OmlxError):
    status = 507
    openai_type = "insufficient_storage"
    anthropic_type = "api_error"
    code = "insufficient_memory"


class ModelImportError(OmlxError):
    """A model file or folder that cannot be imported (bad checksum, unknown architecture)."""


class HubNotFoundError(ModelImportError):
    """No such repo (or it is private and no token may read it) or no such revision on the hub."""

    status = 404
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"
    code = "hub_repo_not_found"


class HubAccessError(ModelImportError):
    """A gated repo whose terms the token's account has not accepted, or a token without access."""

    status = 403
    openai_type = "permission_error"
    anthropic_type = "permission_error"
    code = "hub_access_denied"


class NotAModelError(ModelImportError):
    """A repo that is not an mlx-lm model omlx can serve (GGUF files, PyTorch weights, an
    architecture mlx-lm lacks); the message says what to do instead."""

    status = 422
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    code = "not_an_mlx_model"


class InsufficientDiskError(ModelImportError):
    """Not enough free disk for a download (checked before it starts, or the disk filled up)."""

    status = 507
    openai_type = "insufficient_storage"
    anthropic_type = "api_error"
    code = "insufficient_disk"


class HubUnreachableError(ModelImportError):
    """The hub (``HF_ENDPOINT``) cannot be reached or answered with an error, or a download broke off."""

    status = 502
    openai_type = "server_error"
    anthropic_type = "api_error"
    code = "hub_unreachable"


class ConflictError(OmlxError):
    """What was asked for is already under way (e.g. a pull of a repo that is being pulled)."""

    status = 409
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    code = "conflict"


class ClusterUnavailableError(OmlxError):
    """A pipeline rank is lost or frozen (cluster mode): the request cannot run until the node
    agent re-plans and restarts the workers."""

    status = 503
    openai_type = "server_error"
    anthropic_type = "api_error"
    code = "cluster_unavailable"

    def __init__(self, message: str, *, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)} if self.retry_after_s else {}


class ConfigError(OmlxError):
    """A mistake in the configuration (the TOML file, an ``OMLX_*`` variable, a flag): the message
    names the source, the key and what was expected. Raised before the server starts, which
    refuses to; never an HTTP answer."""


class EngineError(OmlxError):
    """Generation failed for one request; the engine keeps serving the others."""


class ClusterError(OmlxError):
    """Base of cluster-mode control-plane errors (planning, the control channel). The node agent
    turns them into an event, a log line or an error reply on the control channel."""


class PlanError(ClusterError):
    """The model does not fit the nodes' caps under any contiguous split (``omlx.cluster.plan``).

    Attributes:
        shortfall_bytes: The smallest total number of bytes by which the nodes' caps fall short,
            over all contiguous splits in the planned node order (> 0).
    """

    def __init__(self, message: str, *, shortfall_bytes: int) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


class ControlError(ClusterError):
    """A control-channel failure: connection lost, timeout, malformed message (``omlx.cluster.control``)."""


class AuthError(ControlError):
    """The handshake failed: this side or the other does not hold the shared secret."""
