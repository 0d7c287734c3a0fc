"""Configuration: frozen pydantic models built once, at the edge, by pydantic-settings.

Precedence, highest first: command-line flags (`load_config`'s ``flags``, pydantic-settings'
init source) > ``OMLX_*`` environment variables > the TOML file (``--config`` or ``OMLX_CONFIG``,
default ``<base-path>/config.toml``) > defaults. Environment variables are read here and nowhere
else. Every key is a model field whose ``description`` is its documentation (the README's
configuration table is generated from it: ``python -m omlx.cli.config_table``); its TOML key and
environment variable are derived from the field (`setting_keys`). A mistake in any source is a
`ConfigError` naming the source (file, environment, command line), the key as that source names it
(TOML key, ``OMLX_*`` variable, ``--flag``) and what was expected (for an unknown key, the closest
known one: `did_you_mean`); every source is checked, also
where a higher one overrides it, and every number has a range (`Bounds`). ``OMLX_*`` variables that
name no setting are not errors (other tools may set their own): `unknown_env` lists them for a
start-up warning.

Must not: import anything of omlx but ``omlx.errors`` and the value types (``omlx.config_values``);
read the environment outside `load_config`.

TOML layout::

    host = "127.0.0.1"
    port = 8000
    model = "SmolLM2-135M-Instruct"
    max_concurrent_requests = 8
    kv_bits = 8                    # quantize every model's full-attention KV (4 or 8 usual; default off)
    kv_group_size = 64
    api_key = "..."
    context_scale_to = 200000      # Anthropic API: report token counts as if the window were this
    [cache]
    block_size = 256
    hot_cache_max_size = "2GB"
    [aliases]
    "claude-haiku-4-5" = "SmolLM2-135M-Instruct"
    [memory]
    ceiling = "12GB"               # default: total RAM - 8 GB, at least half of RAM
    soft_watermark = 0.90          # fractions of the ceiling
    hard_watermark = 0.97
    [models."SmolLM2-135M-Instruct"]
    context_length = 8192
    default_temperature = 0.7
    ttl_s = 600                    # unload after 10 idle minutes
    pin = false                    # true: load at start, never evict
    aliases = ["gpt-4o-mini"]
    [models."SmolLM2-135M-Instruct".profiles.precise]   # served as "SmolLM2-135M-Instruct:precise"
    default_temperature = 0.0
    default_max_tokens = 256
    [cluster]                      # `omlx serve --cluster`, `omlx cluster join`
    secret = "..."                 # shared by every node (or OMLX_CLUSTER_SECRET)
    peers = ["10.0.0.2:8470"]      # static peers, for networks mDNS does not cross
    control_port = 8470
    memory_cap = "48GB"            # most this node gives the cluster

Environment variables: ``OMLX_<KEY>`` for top-level keys, ``OMLX_MEMORY_<KEY>`` and
``OMLX_CLUSTER_<KEY>`` for the ``[memory]`` and ``[cluster]`` tables, ``OMLX_<KEY>`` for
``[cache]`` (its keys name the cache already); a field may name its own (``OMLX_MODEL``).
Lists are comma-separated (``OMLX_MODEL=a,b``), aliases ``NAME=TARGET`` pairs.
"""

from __future__ import annotations

import contextvars
import difflib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Iterable, Iterator, Mapping

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError,
                      field_validator, model_validator)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from omlx.config_values import (Bounds, Count, Int, Names, OptSize, Port, Positive, Seconds, Share, Size, as_pairs,
                                int_in, none_for, num_in, optional, parse_peer)
from omlx.errors import ConfigError

DEFAULT_BASE_PATH = "~/.omlx"
#: The environment variable naming the config file (``--config`` on the command line).
CONFIG_FILE_ENV = "OMLX_CONFIG"
#: ``kv_bits`` and ``kv_group_size`` values ``mx.quantize`` supports (affine mode).
KV_BITS_CHOICES = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZE_CHOICES = (32, 64, 128)
#: `logging`'s level names (``log_level``).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Ports a cluster worker's ring uses in turn, from ``worker_port`` (`omlx.cluster.launcher.ring_port`).
NUM_RING_PORTS = 32
#: Where a key may be set from; a field's ``sources`` (json_schema_extra) narrows it.
SOURCES = ("file", "env", "flags")




def _key(default: Any = None, description: str = "", *, example: Any, toml: str | None = None,
         env: str | None = None, sources: tuple[str, ...] = SOURCES, factory: Any = None) -> Any:
    """A setting: its default, documentation, an example value (used by the docs and the tests
    that set every key from every source), and where it may come from.

    Args:
        toml: its key in its TOML table when that is not the field name.
        env: its environment variable when that is not the derived one (`setting_keys`).
        sources: the subset of `SOURCES` it may be set from.
    """
    extra: dict[str, Any] = {"sources": list(sources)}
    if toml:
        extra["toml"] = toml
    if env:
        extra["env"] = env
    if factory is not None:
        return Field(default_factory=factory, description=description, examples=[example], json_schema_extra=extra)
    return Field(default, description=description, examples=[example], json_schema_extra=extra)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Bad(ConfigError, ValueError):
    """A check of several keys that fails, raised inside pydantic's validation (so a ValueError);
    ``keys`` (dotted, from the model) are the ones it reads, the first that some source set is
    named in the error `load_config` raises."""

    def __init__(self, keys: tuple[str, ...], message: str):
        super().__init__(message)
        self.keys = keys


# ---- per-model settings --------------------------------------------------------------------------

# The ranges the request APIs enforce on the fields these defaults stand in for
# (`omlx.api.bodies.openai.Sampling`, the widest of the APIs; a test keeps them equal).
Temperature = num_in(0.0, 2.0)
Fraction = num_in(0.0, 1.0)
Penalty = num_in(0.01, 10.0)
#: A number of output tokens (`omlx.api.bodies.base.Tokens`: a signed 32-bit integer).
Tokens = int_in(1, 2**31 - 1)

#: ModelSettings fields a profile may set: per-request behaviour, never what is loaded.
PROFILE_KEYS = (
    "tool_dialect", "default_temperature", "default_top_p", "default_top_k", "default_min_p",
    "default_repetition_penalty", "default_max_tokens", "max_output_tokens", "enable_thinking",
)
#: What a model serves; None in ModelSettings.task means "detected from its config.json".
MODEL_TASKS = ("chat", "embeddings", "rerank")


class ModelSettings(_Frozen):
    """Per-model settings from the ``[models."<id>"]`` TOML tables (each field's description
    says what it does). A request's own fields always win over the ``default_*`` ones;
    ``max_output_tokens`` clamps whatever was asked."""

    context_length: optional(Positive) = Field(None, description="most tokens (prompt + output); none = the model's config")
    tool_dialect: str | None = Field(None, description=(
        "tool-call format (a dialect of `omlx.tool_parsers`, or one of its aliases); none = detected from the chat template"))
    default_temperature: optional(Temperature) = Field(None, description="sampling temperature when a request leaves it out")
    default_top_p: optional(Fraction) = Field(None, description="top-p when a request leaves it out")
    default_top_k: optional(Count) = Field(None, description="top-k when a request leaves it out")
    default_min_p: optional(Fraction) = Field(None, description="min-p when a request leaves it out")
    default_repetition_penalty: optional(Penalty) = Field(None, description="repetition penalty when a request leaves it out")
    default_max_tokens: optional(Tokens) = Field(None, description="output token limit when a request leaves it out")
    max_output_tokens: optional(Tokens) = Field(None, description=(
        "most tokens one response may generate; a request asking for more (Claude Code asks for 32000+) "
        "is clamped to it; none: only the context limits it"))
    enable_thinking: StrictBool | None = Field(None, description=(
        "reasoning on/off when the request does not say; none = the chat template's default"))
    ttl_s: optional(Seconds) = Field(None, description="unload after this many seconds without requests; none = never")
    pin: StrictBool = Field(False, description="load at start and never evict")
    aliases: Names = Field((), description="other names requests may use for this model")
    path: str | None = Field(None, description="the model folder (or .gguf) when it is not `<base-path>/models/<id>`")
    task: str | None = Field(None, description="`chat`, `embeddings` or `rerank`; none = detected from config.json")
    profiles: Mapping[str, ModelSettings] = Field(default_factory=dict, description=(
        "`[models.\"<id>\".profiles.<name>]`: an overlay of the per-request keys above (tool_dialect, "
        "default_*, max_output_tokens, enable_thinking), served as `<id>:<name>` on the same engine"))

    @field_validator("aliases", mode="after")
    @classmethod
    def _aliases_named(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not all(v):
            raise ValueError("aliases must be a list of model names")
        return v

    @field_validator("tool_dialect", mode="after")
    @classmethod
    def _dialect_known(cls, v: str | None) -> str | None:
        """The registry's own name for ``v`` (an alias resolved), when `load_config` was given the registry."""
        loading = _LOADING.get()
        if v is None or loading is None or loading.resolve_dialect is None:
            return v
        return loading.resolve_dialect(v)  # ValueError: unknown, naming the known ones

    @field_validator("task", mode="after")
    @classmethod
    def _task_known(cls, v: str | None) -> str | None:
        if v not in (None, *MODEL_TASKS):
            raise ValueError(f"task must be one of {', '.join(MODEL_TASKS)}")
        return v

    @field_validator("profiles", mode="after")
    @classmethod
    def _profiles_overlay_only(cls, v: Mapping[str, ModelSettings]) -> Mapping[str, ModelSettings]:
        for name, p in v.items():
            if not name or ":" in name or "/" in name:
                raise ValueError(f"bad profile name {name!r} (no ':' or '/')")
            wrong = sorted(p.model_fields_set - set(PROFILE_KEYS))
            if wrong:
                raise ValueError(f"profile {name!r}: {', '.join(map(repr, wrong))} cannot be set in a profile "
                                 f"(allowed: {', '.join(PROFILE_KEYS)})")
        return v


# ---- sections ------------------------------------------------------------------------------------


class MemoryConfig(_Frozen):
    """The process memory limits (`omlx.memory.ProcessMemoryEnforcer`, ``[memory]`` in TOML)."""

    ENV_PREFIX: ClassVar[str] = "OMLX_MEMORY_"

    ceiling_bytes: OptSize = _key(None, (
        "most memory the process may use, e.g. `12GB`; models are unloaded (LRU) to stay under it; "
        "none = total RAM - 8 GB, at least half of RAM"), toml="ceiling", example="12GB")
    soft_watermark: Share = _key(0.90, (
        "fraction of the ceiling above which admission pauses and idle models are evicted; a model "
        "load must leave the process below it"), example=0.8)
    hard_watermark: Share = _key(0.97, (
        "fraction above which the hot KV caches shrink, then models are evicted, then the youngest "
        "request is aborted"), example=0.99)
    load_wait_s: num_in(0) = _key(120.0, (
        "how long a request waits for a model to load or for memory to free up before it gets a 507/529"),
        example=30.0)
    check_interval_s: Seconds = _key(1.0, "period of the memory enforcer and TTL checks, in seconds", example=0.5)

    @model_validator(mode="after")
    def _check(self) -> MemoryConfig:
        if not self.soft_watermark <= self.hard_watermark:
            raise _Bad(("memory.soft_watermark", "memory.hard_watermark"),
                       "memory watermarks must satisfy 0 < soft_watermark <= hard_watermark <= 1")
        return self

    @field_validator("ceiling_bytes", mode="after")
    @classmethod
    def _ceiling(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("memory ceiling must be a positive size, e.g. 12GB")
        return v


class CacheConfig(_Frozen):
    """KV cache tiers (``[cache]`` in TOML)."""

    ENV_PREFIX: ClassVar[str] = "OMLX_"

    block_size: Positive = _key(256, "KV block size in tokens", example=64)
    hot_cache_max_bytes: OptSize = _key(None, "RAM budget of the hot KV tier, e.g. `2GB`; none = derived from memory at start",
                                        toml="hot_cache_max_size", example="2GB")
    enabled: bool = _key(True, "false turns the prefix cache off (for A/B runs)", env="OMLX_CACHE_ENABLED", example=False)
    ssd_cache_dir: str | None = _key(None, "cold KV tier folder: one safetensors file per block; none = `<base-path>/cache`",
                                     example="/tmp/omlx-cache")
    ssd_cache_max_bytes: OptSize = _key(None, (
        "disk budget of the cold tier, e.g. `20GB` (printed at start); none = min(10% of free disk, 50 GB)"),
        toml="ssd_cache_max_size", example="20GB")
    ssd_enabled: bool = _key(True, "false keeps KV blocks in RAM only", env="OMLX_SSD_CACHE_ENABLED", example=False)
    ssd_write_through_hits: Count = _key(2, (
        "write a hot block to disk (high priority) once it was hit this many times; 0 turns that off"), example=0)
    ssd_write_new_blocks: bool = _key(True, (
        "queue every new block and tail for disk at low priority, so a crash (kill -9) loses only the write "
        "queue; those holding generated tokens when the engine idles (or at their first hit), not while requests decode"),
        example=False)


class ClusterConfig(_Frozen):
    """Cluster mode (``[cluster]`` in TOML; see ``omlx.cluster.agent``)."""

    ENV_PREFIX: ClassVar[str] = "OMLX_CLUSTER_"

    secret: str | None = _key(None, "shared secret every node must hold to join (>= 8 bytes); none = not set",
                              example="s3cret-s3cret")
    peers: Names = _key((), "static peers `host:port` (mDNS does not cross subnets or VPNs)", example=["10.0.0.2:8470"])
    control_host: str = _key("0.0.0.0", "address the control channel binds", example="127.0.0.1")
    control_port: Port = _key(8470, "TCP port of the control channel", example=9470)
    mdns: bool = _key(True, "advertise and browse `_omlx._tcp` over zeroconf", example=False)
    heartbeat_interval_s: Seconds = _key(1.0, "seconds between heartbeats to each member", example=0.5)
    heartbeat_timeout_s: Seconds = _key(3.0, "a member silent this long (seconds) has left: a new epoch starts", example=6.0)
    memory_cap_bytes: OptSize = _key(None, "most memory this node gives a pipeline, e.g. `48GB`; none = what is available",
                                     toml="memory_cap", example="48GB")
    headroom_bytes: Size = _key(2 * 10**9, "memory each node keeps free beyond its stage", toml="headroom", example="4GB")
    context_tokens: Positive = _key(4096, "KV reserve per sequence the plan leaves room for, in tokens", example=8192)
    worker_port: int_in(1, 65535 - NUM_RING_PORTS + 1) = _key(8480, (
        "first port of this node's ring endpoint (mx.distributed) in the hostfile; epoch E uses "
        "worker_port + E % 32, so a new epoch never meets the last one's sockets"), example=9480)
    step_timeout_s: Seconds = _key(30.0, (
        "most seconds one pipeline step (or the ring's start) may block before the workers count a peer as lost"),
        example=60.0)
    start_workers: bool = _key(True, (
        "start `omlx cluster worker` for each plan; false = plan only (dry run: status shows the command "
        "line each node would run)"), example=False)

    @field_validator("peers", mode="after")
    @classmethod
    def _peers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for peer in v:  # as the cluster agent reads them (ValueError naming the peer)
            parse_peer(peer, default_port=cls.model_fields["control_port"].default)
        return v

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if not self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise _Bad(("cluster.heartbeat_interval_s", "cluster.heartbeat_timeout_s"),
                       "cluster heartbeat_interval_s must be below heartbeat_timeout_s")
        return self


# ---- the server ----------------------------------------------------------------------------------

#: `load_config`'s sources for the ServerConfig being built in this context (None: only what is
#: passed to the constructor, so ``ServerConfig()`` in a test is the defaults).
_LOADING: contextvars.ContextVar[_Sources | None] = contextvars.ContextVar("omlx_config_sources", default=None)


class ServerConfig(BaseSettings):
    """Everything `omlx serve` needs; built once by the CLI (`load_config`).

    Constructed directly it holds its defaults and what is passed (no environment, no file).
    Each field's description says what it does.
    """

    model_config = SettingsConfigDict(frozen=True, extra="forbid", case_sensitive=True, validate_default=False)
    ENV_PREFIX: ClassVar[str] = "OMLX_"

    host: str = _key("127.0.0.1", "address to bind; any other than loopback requires an API key", example="127.0.0.2")
    port: Port = _key(8000, "TCP port of the HTTP API", example=7001)
    models: Names = _key((), (
        "model ids, mlx-lm folders or `.gguf` files to load at start (the first is the default); "
        "none = the embedded SmolLM2-135M-Instruct"), toml="model", example=["smol", "other"])
    max_concurrent_requests: int_in(1, 1024) = _key(8, "requests decoding at once per model", example=3)
    max_queued_requests: Count = _key(64, "requests waiting per model beyond those before a 429 with `Retry-After`",
                                    example=16)
    base_path: str = _key(DEFAULT_BASE_PATH, "omlx's home: models, cache, config", example="/tmp/omlx-home")
    hub_cache_dir: str | None = _key(None, (
        "the Hugging Face hub cache omlx reads models from and pulls into; none = huggingface_hub's own "
        "(`HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`)"), example="/tmp/hub")
    api_key: str | None = _key(None, "required on every route when set (`Authorization: Bearer` or `x-api-key`)",
                               example="sk-local")
    max_body_bytes: Size = _key(32 * 1024 * 1024, "larger request bodies get a 413", example="64MB")
    keepalive_s: Seconds = _key(5.0, "seconds between SSE keep-alives while a prompt is queued or prefilled", example=2.0)
    idle_text_after_s: Annotated[float | None, BeforeValidator(none_for("", "none", "off")),
                                 AfterValidator(Bounds(0))] = _key(60.0, (
        "once a stream has gone this many seconds without content (a long prefill, a long queue wait), "
        "its keep-alives become events the clients' stream idle watchdogs count (*Long first prompts*): "
        "on Anthropic streams empty `text_delta` events in an open text block (Claude Code ignores `ping`; "
        "the turn's first block is then a text block, empty when the model's answer starts with a tool "
        "call), on Responses streams `response.in_progress` again (Codex ignores SSE comments); `off` "
        "keeps pings and comments; 0 switches at once. Chat Completions streams always send comments"), example=30.0)
    preload_blas: bool = _key(True, "re-exec with OpenBLAS preloaded on Linux when MLX would use reference BLAS",
                              example=False)
    log_level: str = _key("INFO", f"{', '.join(LOG_LEVELS)} (any case)", example="DEBUG")
    disable_kernels: Names = _key((), (
        "native kernels to keep off (names from `metal/`, or `all`); each is reported at start-up and in /health"),
        example=["kv_gather"])
    strict_content: bool = _key(False, (
        "answer a 400 for content a text model cannot read (images, documents) instead of serving a placeholder"),
        example=True)
    cache: CacheConfig = Field(default_factory=CacheConfig, description="`[cache]`: the KV cache tiers")
    aliases: Annotated[Mapping[str, str], BeforeValidator(as_pairs)] = _key(None, (
        "`[aliases]`: requested model id -> served id (e.g. the ids Claude Code asks for); flags, env "
        "(`NAME=TARGET,...`) and file entries are merged, per name the higher source wins"),
        factory=dict, example={"claude-haiku-4-5": "smol"})
    context_scale_to: Annotated[int | None, BeforeValidator(none_for("", 0, "0")), AfterValidator(Bounds(1))] = _key(
        None, (
        "when set, the Anthropic API reports token counts scaled by `context_scale_to / model context` so "
        "a client that assumes this larger window compacts at the model's real limit (`docs/ANTHROPIC.md`); "
        "none reports real counts"), example=200000)
    kv_bits: Annotated[int | None, BeforeValidator(none_for("", "none", "off"))] = _key(None, (
        "quantize every chat model's full-attention KV cache to this many bits (2, 3, 4, 5, 6, 8; mlx-lm's "
        "`QuantizedKVCache`, from the first token, batched by omlx); the prefix cache keeps the quantized "
        "blocks (their own namespace); none keeps the model's dtype (see *--kv-bits* below the table)"),
        example=8)
    kv_group_size: Int = _key(64, "elements per quantization group along the head dim with `kv_bits`: 32, 64 or 128",
                              example=32)
    prefill_step_size: Annotated[int | None, BeforeValidator(none_for("", "auto", 0, "0")),
                                 AfterValidator(Bounds(1))] = _key(None, (
        "most prompt tokens of one prefill chunk (alone and beside decoding streams), a multiple of the "
        "block size; none = measured per model and device at load (logged). Pin it to make two servers "
        "cut prompts alike (different cuts change the last bits of KV values and logits)"), example=512)
    max_tpot_slowdown: num_in(0) = _key(2.0, (
        "prefill pacing: while prompts prefill beside decoding sequences, their mean time per output "
        "token is held to at most this many times a decode-only step by letting a prefill chunk into "
        "only some steps (`omlx.engine.pacing`); a prompt that arrives while nothing decodes, or whose "
        "whole prefill is one chunk, is never held. Values <= 1 turn pacing off (a chunk in every step: "
        "fastest prefill, slowest streams)"), example=3.5)
    lookup_draft_tokens: int_in(0, 64) = _key(0, (
        "experimental prompt-lookup speculative decoding: most tokens drafted per verify step for a "
        "request without penalties or structured output, alone or in a batch (`omlx.engine.lookup`, "
        "`omlx.engine.speculate`; greedy output equals plain greedy decoding in float32, while bf16 or "
        "quantized weights on a GPU can round a near-tie the other way; sampled output keeps the "
        "model's distribution and a seed's tokens); 0 = off (see *--lookup-draft-tokens* below the table)"), example=4)
    model_settings: Mapping[str, ModelSettings] = _key(None, (
        "per-model settings, one table per model id (the next table)"), toml="models",
        sources=("file", "flags"), factory=dict, example={"smol": {"context_length": 4096}})
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="`[memory]`: the process memory limits")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="`[cluster]`: cluster mode")
    test_fault: str | None = _key(None, (
        "TEST ONLY: faults to inject into generation (`omlx.engine.faults`); never set in production"),
        sources=("env",), example="forward:seed=7")
    test_park: bool = _key(False, (
        "TEST ONLY: requests may ask to wait at an await point of their route until their client leaves "
        "(`omlx.api.park`); never set in production"), sources=("env",), example=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   **_: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        """init (the flags) > `load_config`'s environment and file sources, when it is loading."""
        loading = _LOADING.get()
        if loading is None:
            return (init_settings,)
        return (init_settings, *loading.lower)

    @field_validator("log_level", mode="after")
    @classmethod
    def _log_level(cls, v: str) -> str:
        if v.strip().upper() not in LOG_LEVELS:
            raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
        return v.strip().upper()

    @field_validator("kv_bits", mode="after")
    @classmethod
    def _kv_bits(cls, v: int | None) -> int | None:
        if v is not None and v not in KV_BITS_CHOICES:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS_CHOICES))}, got {v}")
        return v

    @field_validator("kv_group_size", mode="after")
    @classmethod
    def _kv_group_size(cls, v: int) -> int:
        if v not in KV_GROUP_SIZE_CHOICES:
            raise ValueError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZE_CHOICES))}, got {v}")
        return v

    @model_validator(mode="after")
    def _prefill_in_blocks(self) -> ServerConfig:
        p, b = self.prefill_step_size, self.cache.block_size
        if p is not None and (p < b or p % b):
            raise _Bad(("prefill_step_size", "cache.block_size"), f"prefill_step_size must be a positive multiple of block_size ({b}), got {p}")
        return self

    @property
    def base_dir(self) -> Path:
        return Path(os.path.expanduser(self.base_path))

    @property
    def models_dir(self) -> Path:
        return self.base_dir / "models"

    @property
    def hub_cache(self) -> Path | None:
        """``hub_cache_dir`` as a path (None: huggingface_hub's default, see `omlx.engine.hub.cache_dir`)."""
        return Path(os.path.expanduser(self.hub_cache_dir)) if self.hub_cache_dir else None

    @property
    def ssd_cache_dir(self) -> Path:
        return Path(os.path.expanduser(self.cache.ssd_cache_dir)) if self.cache.ssd_cache_dir else self.base_dir / "cache"


# ---- keys: where each field is set from ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SettingKey:
    """One settable key of ServerConfig.

    Attributes:
        path: attribute names from ServerConfig down, e.g. ``("cache", "block_size")``.
        info: the pydantic field (description, default, examples).
        toml: its dotted TOML key, e.g. ``"cache.hot_cache_max_size"``.
        env: its environment variable; None when it cannot be set from the environment.
        sources: the subset of `SOURCES` it may be set from.
    """

    path: tuple[str, ...]
    info: FieldInfo
    toml: str
    env: str | None
    sources: tuple[str, ...]

    @property
    def name(self) -> str:
        """The dotted attribute path (the key of `load_config`'s ``flags``)."""
        return ".".join(self.path)


def _extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def _section_of(info: FieldInfo) -> type[BaseModel] | None:
    ann = info.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _keys_of(owner: type[BaseModel], fields: Mapping[str, FieldInfo], prefix: tuple[str, ...]) -> Iterator[SettingKey]:
    for name, info in fields.items():
        extra = _extra(info)
        toml = extra.get("toml", name)
        sources = tuple(extra.get("sources", SOURCES))
        env = (extra.get("env") or owner.ENV_PREFIX + toml.upper()) if "env" in sources else None  # type: ignore[attr-defined]
        yield SettingKey((*prefix, name), info, ".".join((*prefix, toml)), env, sources)


def setting_keys() -> Iterator[SettingKey]:
    """Every key of ServerConfig and of its sections (``[cache]``, ``[memory]``, ``[cluster]``),
    in declaration order; the docs and the tests walk this."""
    for name, info in ServerConfig.model_fields.items():
        section = _section_of(info)
        if section is None:
            yield from _keys_of(ServerConfig, {name: info}, ())
        else:
            yield from _keys_of(section, section.model_fields, (name,))


#: ``OMLX_*`` variables omlx uses that are not settings (`unknown_env` does not name them).
OTHER_ENV = {
    CONFIG_FILE_ENV: "the config file (`--config`)",
    "OMLX_BLAS_REEXEC": "a marker the BLAS re-exec sets for its own child (omlx.cli.common)",
    "OMLX_LAUNCH_API_KEY": "what `omlx launch codex` hands Codex as its env_key; Codex reads it",
}


def closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The one of ``known`` closest to ``name`` by difflib's ratio, if it reaches ``cutoff``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str] | Mapping[str, str]) -> str:
    """`` (did you mean X?)`` with X the closest of ``known`` to ``name`` (`closest`, ratio >= 0.6),
    or ``""``; a mapping is matched on its keys and names their values."""
    shown = known if isinstance(known, Mapping) else {k: k for k in known}
    close = closest(name, shown)
    return f" (did you mean {shown[close]}?)" if close is not None else ""


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """One line for each ``OMLX_*`` variable of ``env`` (default ``os.environ``) that omlx does not
    read, with the closest name it does read when one is close (difflib), for a start-up warning.

    Not an error: other tools and scripts may set ``OMLX_*`` variables of their own, and a
    variable omlx does not read changes nothing.
    """
    env = os.environ if env is None else env
    known = {k.env for k in setting_keys() if k.env} | set(OTHER_ENV)
    tails = {name.removeprefix("OMLX_"): name for name in known}
    lines = []
    for name in sorted(n for n in env if n.startswith("OMLX_") and n not in known):
        lines.append(f"environment variable {name} is not an omlx setting and is ignored"
                     f"{did_you_mean(name.removeprefix('OMLX_'), tails)}")
    return lines


# ---- sources -------------------------------------------------------------------------------------


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _has(tree: Any, path: tuple[Any, ...]) -> bool:
    return _at(tree, path, missing := object()) is not missing


def _at(tree: Any, path: tuple[Any, ...], missing: Any = None) -> Any:
    """The value at ``path`` in nested mappings; ``missing`` where there is none."""
    for p in path:
        if not isinstance(tree, Mapping) or p not in tree:
            return missing
        tree = tree[p]
    return tree


class _EnvSource(PydanticBaseSettingsSource):
    """``OMLX_*`` variables of ``env`` -> nested values, one variable per key (`setting_keys`);
    empty variables count as unset."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]):
        super().__init__(settings_cls)
        self.values: dict[str, Any] = {}
        self.names: dict[tuple[str, ...], str] = {}  # path -> the variable it came from (for errors)
        for key in setting_keys():
            if key.env and env.get(key.env, "") != "":
                _put(self.values, key.path, env[key.env])
                self.names[key.path] = key.env

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ builds the whole tree

    def __call__(self) -> dict[str, Any]:
        return self.values


class _FileSource(TomlConfigSettingsSource):
    """The TOML file -> nested values under the model's attribute names (``[memory] ceiling`` ->
    ``memory.ceiling_bytes``, ``[models."<id>"]`` -> ``model_settings``; `setting_keys`);
    ``written`` keeps the key as the file wrote it where that is not its TOML key (for errors)."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path):
        if path.is_dir():
            raise ConfigError(f"cannot read config file {path}: it is a directory (name the file, e.g. {path / 'config.toml'})")
        if not path.is_file():
            raise ConfigError(f"cannot read config file {path}: no such file")
        try:
            super().__init__(settings_cls, toml_file=path)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        self.path = path
        keys = list(setting_keys())
        # a key as the file names it, else by its attribute name (`[memory] ceiling_bytes`)
        by_toml = {**{k.path: k for k in keys}, **{tuple(k.toml.split(".")): k for k in keys}}
        values: dict[str, Any] = {}
        self.written: dict[tuple[str, ...], str] = {}
        for top, value in self.toml_data.items():
            if top == "models" and not isinstance(value, Mapping):
                _put(values, ("models",), value)  # `models = [...]`: a list of models, as `model`
                self.written[("models",)] = "models"
                continue
            items = value.items() if isinstance(value, Mapping) and top in ("cache", "memory", "cluster") else [(None, value)]
            for sub, v in items:
                where = (top,) if sub is None else (top, sub)
                key = by_toml.get(where)
                if key is not None and "file" not in key.sources:
                    raise ConfigError(f"{key.toml} cannot be set in config file {path}: only by environment variable "
                                      f"{key.env}")
                _put(values, key.path if key else where, v)
                if key is not None and key.toml != ".".join(where):
                    self.written[key.path] = ".".join(where)
        self.init_kwargs = values

    def __call__(self) -> dict[str, Any]:
        return self.init_kwargs


@dataclass(slots=True)
class _Sources:
    """What `load_config` merges, and where each value came from (for error messages).

    Attributes:
        flag_names: dotted key -> the command-line flag that set it (``--memory-ceiling``); a key
            not named here is shown as ``--`` + its last part, dashed.
        resolve_dialect: a tool dialect name -> the registry's name (ValueError when unknown);
            None: ``tool_dialect`` is not checked.
    """

    flags: dict[str, Any]
    env: _EnvSource
    file: _FileSource | None
    flag_names: Mapping[str, str] = field(default_factory=dict)
    resolve_dialect: Callable[[str], str] | None = None

    @property
    def lower(self) -> tuple[PydanticBaseSettingsSource, ...]:
        """The sources below the flags, highest first."""
        return (self.env,) if self.file is None else (self.env, self.file)

    def each(self) -> Iterator[_Sources]:
        """Each source alone (flags, env, file), so a value a higher source overrides is checked too."""
        none = _EnvSource(ServerConfig, {})
        yield _Sources(self.flags, none, None, self.flag_names, self.resolve_dialect)
        yield _Sources({}, self.env, None, self.flag_names, self.resolve_dialect)
        if self.file is not None:
            yield _Sources({}, none, self.file, self.flag_names, self.resolve_dialect)

    def _trees(self) -> Iterator[tuple[str, dict[str, Any]]]:
        yield "flags", self.flags
        yield "env", self.env.values
        if self.file is not None:
            yield "file", self.file.init_kwargs

    def origin(self, loc: tuple[Any, ...]) -> tuple[str, str, Any]:
        """Where the value at ``loc`` came from: (the key as the user wrote it there: the flag,
        the environment variable or the TOML key; the source; the value it gave), the highest
        source holding the longest part of ``loc``."""
        for n in range(len(loc), 0, -1):
            for source, tree in self._trees():
                if not _has(tree, loc[:n]):
                    continue
                if source == "flags":
                    return self._flag(loc), "the command line", _at(tree, loc)
                if source == "env":
                    var = next(v for k, v in self.env.names.items() if k[:n] == loc[:n])
                    return var, "the environment", _at(tree, loc)
                return self._file_key(loc), f"config file {self.file.path}", _at(tree, loc)  # type: ignore[union-attr]
        return _dotted(loc), "the defaults", None

    def _file_key(self, loc: tuple[Any, ...]) -> str:
        """The key at ``loc`` as the file wrote it (``models = 3`` is ``models``, not ``model``)."""
        written = self.file.written if self.file is not None else {}
        for n in range(len(loc), 0, -1):
            if loc[:n] in written:
                return ".".join([written[loc[:n]], *map(str, loc[n:])])
        return _toml_key(loc)

    def _flag(self, loc: tuple[Any, ...]) -> str:
        for key in setting_keys():
            if tuple(loc[:len(key.path)]) == key.path:
                flag = self.flag_names.get(key.name) or "--" + key.path[-1].replace("_", "-")
                return ".".join([flag, *map(str, loc[len(key.path):])])
        return _dotted(loc)

    def holds(self, loc: tuple[Any, ...]) -> bool:
        """Whether some source set the value at ``loc`` itself (not only a table above it)."""
        return any(_has(tree, loc) for _, tree in self._trees())


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _toml_key(loc: tuple[Any, ...]) -> str:
    """``("cache", "hot_cache_max_bytes")`` -> ``cache.hot_cache_max_size``; ``("model_settings",
    "m", "pin")`` -> ``models."m".pin``."""
    if loc[:1] == ("model_settings",):
        rest = [f'"{loc[1]}"' if i == 0 else str(p) for i, p in enumerate(loc[1:])]
        return ".".join(["models", *rest])
    for key in setting_keys():
        if tuple(loc[:len(key.path)]) == key.path:
            return ".".join([key.toml, *map(str, loc[len(key.path):])])
    return _dotted(loc)


def _keys_in(table: tuple[Any, ...]) -> list[str]:
    """The keys a TOML table takes, as written there: top level (with the sections' keys dotted,
    ``cache.block_size``, which TOML reads as ``[cache] block_size``), a section, a
    ``[models."<id>"]`` table or one of its profiles."""
    if table[:1] == ("model_settings",):
        return list(PROFILE_KEYS) if "profiles" in table else list(ModelSettings.model_fields)
    keys = [k for k in setting_keys() if "file" in k.sources]
    if not table:
        return [k.toml for k in keys]
    return [k.toml.split(".")[-1] for k in keys if k.path[0] == table[0]]


#: pydantic error types -> what was expected (the rest keep pydantic's message).
_EXPECTED = {
    "int_parsing": "expected an integer", "int_type": "expected an integer",
    "int_from_float": "expected an integer", "float_parsing": "expected a number",
    "float_type": "expected a number", "bool_parsing": "expected true or false",
    "bool_type": "expected true or false", "string_type": "expected a string",
    "tuple_type": "expected a list", "list_type": "expected a list",
    "dict_type": "expected a table", "mapping_type": "expected a table", "model_type": "expected a table",
    "model_attributes_type": "expected a table", "finite_number": "expected a finite number",
}


def _message(err: Mapping[str, Any], sources: _Sources) -> str:
    """One pydantic error -> a sentence naming the key, the value, what was expected and the source."""
    loc = tuple(err["loc"])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, _Bad):
        named = [tuple(k.split(".")) for k in cause.keys]
        loc = next((k for k in named if sources.holds(k)), named[0])
    key, origin, value = sources.origin(loc)
    if err["type"] == "extra_forbidden":
        *table, name = loc
        known = _keys_in(tuple(table))
        if not table and isinstance(err.get("input"), Mapping):
            # a table (`[cahce]`, `cahce.block_size = 1`): matched on the names a top-level
            # table can have (cache, cluster, models, ...), not on the dotted keys under them
            known = list(dict.fromkeys(k.split(".")[0] for k in known))
        hint = did_you_mean(str(name), known)
        if table[:1] == ["model_settings"]:
            return f"unknown setting {name!r} in [{_toml_key(tuple(table))}]{hint}, from {origin}"
        return f"unknown {table[0] + ' ' if table else ''}setting {name!r}{hint}, from {origin}"
    return bad_value(key, value if isinstance(cause, _Bad) else err.get("input"), expected(err), origin)


def expected(err: Mapping[str, Any]) -> str:
    """What one pydantic error says was expected (``expected an integer``), else its own message."""
    cause = (err.get("ctx") or {}).get("error")
    return _EXPECTED.get(err["type"]) or (str(cause) if cause is not None else err["msg"])


def bad_value(key: str, value: Any, reason: str, origin: str) -> str:
    """``bad value for KEY: VALUE (REASON), from ORIGIN``: the one wording of a bad value, also for a
    typed command-line option refused before the config sees it (`omlx.cli.common.OneLineErrors`)."""
    shown = "" if isinstance(value, (Mapping, BaseModel)) else f": {value!r}"
    return f"bad value for {key}{shown} ({reason}), from {origin}"


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
    *,
    flag_names: Mapping[str, str] | None = None,
    resolve_dialect: Callable[[str], str] | None = None,
) -> ServerConfig:
    """Merge flags > env > file > defaults into a frozen ServerConfig.

    Every source is checked on its own first, so a bad value is an error even where a higher
    source overrides it; checks across keys (a watermark below the other) run on the merged values.

    Args:
        flags: values given on the command line, keys as in ServerConfig (dotted for the
            sections: ``cache.block_size``, ``memory.ceiling_bytes``); None values and empty
            tuples are ignored.
        env: the environment (defaults to ``os.environ``).
        config_file: TOML path; default ``$OMLX_CONFIG``, else ``<base-path>/config.toml`` when it
            exists.
        flag_names: dotted key -> the flag the command line gave it by (``memory.ceiling_bytes``
            -> ``--memory-ceiling``), for errors; default ``--`` + the key's last part, dashed.
        resolve_dialect: checks each ``tool_dialect`` (the CLI passes
            `omlx.tool_parsers.resolve_dialect_name`, which this layer may not import): returns
            the registry's name for it, raises ValueError naming the known ones; None: unchecked.

    Raises:
        ConfigError: on an unknown key, a bad value or an unreadable file, in one line; each
            mistake names its source (the file, the environment, the command line), the key as
            written there (TOML key, ``OMLX_*`` variable, ``--flag``) and what was expected.
    """
    env = os.environ if env is None else env
    nested: dict[str, Any] = {}
    allowed = {k.name: k for k in setting_keys()}
    for name, value in (flags or {}).items():
        if value is None or value == ():
            continue
        key = allowed.get(name)
        if key is not None and "flags" not in key.sources:
            raise ConfigError(f"{name} cannot be set on the command line: only by environment variable {key.env}")
        _put(nested, tuple(name.split(".")), value)
    env_source = _EnvSource(ServerConfig, env)
    base_path = nested.get("base_path") or env_source.values.get("base_path") or DEFAULT_BASE_PATH
    path = config_file or env.get(CONFIG_FILE_ENV) or None
    if path is None:
        candidate = Path(os.path.expanduser(str(base_path))) / "config.toml"
        path = candidate if candidate.exists() else None
    sources = _Sources(nested, env_source, _FileSource(ServerConfig, Path(path)) if path is not None else None,
                       dict(flag_names or {}), resolve_dialect)
    problems: dict[str, None] = {}  # in order, each once
    for alone in sources.each():
        got = _validate(alone)
        if not isinstance(got, ServerConfig):  # checks across keys wait for the merged values
            problems.update(dict.fromkeys(_message(err, alone) for err in got if not _across(err)))
    if not problems:
        got = _validate(sources)
        if isinstance(got, ServerConfig):
            return got
        problems.update(dict.fromkeys(_message(err, sources) for err in got))
    raise ConfigError("; ".join(problems))


def _validate(sources: _Sources) -> ServerConfig | list[Any]:
    """ServerConfig from ``sources``, or pydantic's errors."""
    token = _LOADING.set(sources)
    try:
        return ServerConfig(**sources.flags)
    except ValidationError as e:
        return e.errors()
    finally:
        _LOADING.reset(token)


def _across(err: Mapping[str, Any]) -> bool:
    """Whether a pydantic error is a check across keys (`_Bad`): one source may set only one of them."""
    return isinstance((err.get("ctx") or {}).get("error"), _Bad)
