"""Configuration: frozen dataclasses built once, at the edge.

Precedence, highest first: command-line flags > ``OMLX_*`` environment variables > the TOML
file (``--config``, default ``<base-path>/config.toml``) > defaults. Environment variables are
read here and nowhere else.

TOML layout::

    host = "127.0.0.1"
    port = 8000
    model = "SmolLM2-135M-Instruct"
    max_concurrent_requests = 8
    kv_bits = 8                    # quantize every model's full-attention KV (4 or 8 usual; default off)
    kv_group_size = 64
    api_key = "..."
    context_scale_to = 200000      # Anthropic API: report token counts as if the window were this
    strict_content = false         # true: an image or file a text model cannot read is a 400
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
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from omlx.errors import InvalidRequestError

DEFAULT_BASE_PATH = "~/.omlx"
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
#: ``kv_bits`` and ``kv_group_size`` values ``mx.quantize`` supports (affine mode).
KV_BITS_CHOICES = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZE_CHOICES = (32, 64, 128)


def parse_size(value: str | int | float) -> int:
    """Parse a byte size such as ``"8GB"``, ``"512MiB"`` or ``1048576``.

    Returns:
        The size in bytes.

    Raises:
        InvalidRequestError: if the text is not a size.
    """
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise InvalidRequestError(f"not a byte size: {value!r} (use e.g. 512MB, 8GB)")
    unit = (m.group(2) or "").upper()
    binary = "I" in unit
    letter = unit[:1] if unit and unit != "B" else ""
    mult = (1024 ** "KMGT".index(letter) * 1024 if binary else _UNITS[letter]) if letter else 1
    return int(float(m.group(1)) * mult)


#: ModelSettings fields a profile may set: per-request behaviour, never what is loaded.
PROFILE_KEYS = (
    "tool_dialect", "default_temperature", "default_top_p", "default_top_k", "default_min_p",
    "default_repetition_penalty", "default_max_tokens", "max_output_tokens", "enable_thinking",
)
#: What a model serves; None in ModelSettings.task means "detected from its config.json".
MODEL_TASKS = ("chat", "embeddings", "rerank")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Per-model settings from the ``[models."<id>"]`` TOML tables.

    A request's own fields always win over the ``default_*`` ones; ``max_output_tokens`` clamps
    whatever was asked.

    Attributes:
        context_length: most tokens (prompt + output); None = the model's config.
        tool_dialect: tool-call format; None = detected from the chat template.
        default_temperature, default_top_p, default_top_k, default_min_p,
            default_repetition_penalty, default_max_tokens: sampling used when a request
            leaves the field out.
        max_output_tokens: most tokens one response may generate; a request asking for more
            (Claude Code asks for 32000+) is clamped to it. None: only the context limits it.
        enable_thinking: reasoning on/off when the request does not say; None = the template's.
        ttl_s: unload after this many seconds without requests; None = never.
        pin: load at start and never evict.
        aliases: other names requests may use for this model.
        path: the model folder (or .gguf) when it is not ``<base-path>/models/<id>``.
        task: "chat", "embeddings" or "rerank"; None = detected from config.json.
        profiles: name -> overlay (only PROFILE_KEYS set), served as ``<id>:<name>`` on the same
            engine.
    """

    context_length: int | None = None
    tool_dialect: str | None = None
    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None
    default_min_p: float | None = None
    default_repetition_penalty: float | None = None
    default_max_tokens: int | None = None
    max_output_tokens: int | None = None
    enable_thinking: bool | None = None
    ttl_s: float | None = None
    pin: bool = False
    aliases: tuple[str, ...] = ()
    path: str | None = None
    task: str | None = None
    profiles: Mapping[str, ModelSettings] = field(default_factory=dict)


_SETTING_TYPES: dict[str, tuple[type, ...]] = {
    "context_length": (int,), "tool_dialect": (str,), "default_temperature": (int, float),
    "default_top_p": (int, float), "default_top_k": (int,), "default_min_p": (int, float),
    "default_repetition_penalty": (int, float), "default_max_tokens": (int,),
    "max_output_tokens": (int,), "enable_thinking": (bool,), "ttl_s": (int, float), "pin": (bool,),
    "path": (str,), "task": (str,),
}


def parse_model_settings(model_id: str, table: Mapping[str, Any], *, profile: str | None = None) -> ModelSettings:
    """One ``[models."<id>"]`` table (or one of its ``profiles.<name>`` tables) -> ModelSettings.

    Raises:
        InvalidRequestError: an unknown key, a value of the wrong type, or a profile setting
            something only a model can (ttl_s, pin, path, ...); the message names the key.
    """
    where = f'models."{model_id}"' + (f".profiles.{profile}" if profile else "")
    if not isinstance(table, Mapping):
        raise InvalidRequestError(f"[{where}] must be a table")
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if profile is not None and key not in PROFILE_KEYS:
            raise InvalidRequestError(f"[{where}]: {key!r} cannot be set in a profile (allowed: {', '.join(PROFILE_KEYS)})")
        if key == "aliases":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) and a for a in value):
                raise InvalidRequestError(f"[{where}].aliases must be a list of model names")
            kwargs["aliases"] = tuple(value)
        elif key == "profiles":
            if not isinstance(value, Mapping):
                raise InvalidRequestError(f"[{where}].profiles must be a table of tables")
            for name in value:
                if not name or ":" in name or "/" in name:
                    raise InvalidRequestError(f"[{where}]: bad profile name {name!r} (no ':' or '/')")
            kwargs["profiles"] = {str(n): parse_model_settings(model_id, t, profile=str(n)) for n, t in value.items()}
        elif key in _SETTING_TYPES:
            types = _SETTING_TYPES[key]
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                raise InvalidRequestError(f"[{where}].{key} has the wrong type: {value!r}")
            kwargs[key] = float(value) if float in types else value
        else:
            raise InvalidRequestError(f"[{where}]: unknown setting {key!r}")
    if kwargs.get("task") not in (None, *MODEL_TASKS):
        raise InvalidRequestError(f"[{where}].task must be one of {', '.join(MODEL_TASKS)}")
    if kwargs.get("ttl_s") is not None and kwargs["ttl_s"] <= 0:
        raise InvalidRequestError(f"[{where}].ttl_s must be > 0 (leave it out for no TTL)")
    return ModelSettings(**kwargs)


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """The process memory limits (`omlx.memory.ProcessMemoryEnforcer`, ``[memory]`` in TOML).

    Attributes:
        ceiling_bytes: most memory the process may use; None = total RAM - 8 GB, at least half
            of RAM (see ``omlx.memory.default_ceiling_bytes``).
        soft_watermark: fraction of the ceiling above which admission pauses and idle models are
            evicted; a model load must leave the process below it.
        hard_watermark: fraction above which the hot KV caches shrink, then models are evicted,
            then the youngest request is aborted.
        load_wait_s: how long a request waits for a model to load or for memory to free up
            before it gets a 507/529.
        check_interval_s: period of the enforcer and TTL checks.
    """

    ceiling_bytes: int | None = None
    soft_watermark: float = 0.90
    hard_watermark: float = 0.97
    load_wait_s: float = 120.0
    check_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """KV cache tiers.

    Attributes:
        block_size: tokens per KV block.
        hot_cache_max_bytes: RAM budget of the hot tier; None = derived from memory at start.
        enabled: False turns the prefix cache off (for A/B runs).
        ssd_cache_dir: cold tier folder; None = ``<base-path>/cache``.
        ssd_cache_max_bytes: disk budget; None = a bounded fraction of free disk.
        ssd_enabled: False keeps the cache in RAM only.
        ssd_write_through_hits: write a hot block to disk once it was hit this many times
            (high priority); 0 turns that off.
        ssd_write_new_blocks: queue every new full block for disk at low priority, so a
            crash (kill -9) loses only the write queue.
    """

    block_size: int = 256
    hot_cache_max_bytes: int | None = None
    enabled: bool = True
    ssd_cache_dir: str | None = None
    ssd_cache_max_bytes: int | None = None
    ssd_enabled: bool = True
    ssd_write_through_hits: int = 2
    ssd_write_new_blocks: bool = True


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Cluster mode (``[cluster]`` in TOML; see ``omlx.cluster.agent``).

    Attributes:
        secret: shared secret every node must hold to join (>= 8 bytes); None = not set.
        peers: static peers ``host:port`` (mDNS does not cross subnets or VPNs).
        control_host: address the control channel binds.
        control_port: its TCP port.
        mdns: advertise and browse ``_omlx._tcp`` over zeroconf.
        heartbeat_interval_s: period of heartbeats to each member.
        heartbeat_timeout_s: a member silent this long has left (a new epoch starts).
        memory_cap_bytes: most memory this node gives a pipeline; None = what is available.
        headroom_bytes: memory each node keeps free beyond its stage.
        context_tokens: KV reserve per sequence the plan leaves room for.
        worker_port: first port of this node's ring endpoint (mx.distributed) in the hostfile;
            epoch E uses worker_port + E % 32, so a new epoch never meets the last one's sockets.
        step_timeout_s: most seconds one pipeline step (or the ring's start) may block before
            the workers count a peer as lost.
        start_workers: start `omlx cluster worker` for each plan; False = plan only (dry run:
            status shows the command line each node would run).
    """

    secret: str | None = None
    peers: tuple[str, ...] = ()
    control_host: str = "0.0.0.0"
    control_port: int = 8470
    mdns: bool = True
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    memory_cap_bytes: int | None = None
    headroom_bytes: int = 2 * 10**9
    context_tokens: int = 4096
    worker_port: int = 8480
    step_timeout_s: float = 30.0
    start_workers: bool = True


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `omlx serve` needs; built once by the CLI.

    Attributes:
        host, port: where to listen.
        models: model ids or paths to load at start (the first is the default).
        max_concurrent_requests: requests decoding at once per model.
        max_queued_requests: requests waiting beyond that before a 429.
        base_path: omlx's home (models, cache, config).
        hub_cache_dir: the Hugging Face hub cache omlx reads models from and pulls into; None =
            huggingface_hub's own (``HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``).
        api_key: required on every route when set.
        max_body_bytes: larger request bodies get a 413.
        keepalive_s: SSE keep-alive period while a prompt is prefilled.
        idle_text_after_s: Anthropic streams only: once a stream has gone this many seconds
            without content (a long prefill, a long queue wait), its keep-alives become empty
            ``text_delta`` events in an open text block, because Claude Code's stream idle
            watchdog (300 s) ignores ``ping`` events; None keeps pings. The turn's first block
            is then a text block, empty when the model's answer starts with a tool call.
        preload_blas: re-exec with OpenBLAS preloaded on Linux when MLX would use reference BLAS.
        disable_kernels: native kernels to keep off (names from ``metal/``, or "all"); each is
            reported at start-up and in /health.
        aliases: requested model id -> served id; flags, env and file entries are merged (per name,
            the higher source wins).
        context_scale_to: when set, the Anthropic API reports token counts scaled by
            ``context_scale_to / model context`` so a client that assumes this larger window
            compacts at the model's real limit; None reports real counts.
        kv_bits: quantize every chat model's full-attention KV cache to this many bits (mlx-lm's
            ``QuantizedKVCache``, from the first token); None keeps it in the model's dtype.
        kv_group_size: elements per quantization group along the head dim (with ``kv_bits``).
        prefill_step_size: most prompt tokens of one prefill chunk (alone and beside decoding
            streams), a multiple of the block size; None = measured per model and device at load
            (`omlx.engine.runner.measured_step_sizes`). Pin it to make two servers cut prompts
            alike (different cuts change the last bits of KV values and logits).
        max_tpot_slowdown: while prompts prefill beside decoding sequences, the mean step time
            (time per output token of those sequences) is held to at most this many times a
            decode-only step by letting a prefill chunk into only some steps
            (`omlx.engine.pacing`); a prompt that arrives while nothing decodes is never held.
            Values <= 1 turn pacing off (a chunk in every step: fastest prefill, slowest streams).
        lookup_draft_tokens: prompt-lookup speculative decoding: most tokens drafted per verify
            step for a greedy request decoding alone (`omlx.engine.lookup`); 0 (default) = off.
        strict_content: content a text model cannot read (an image, a non-text document, audio,
            a file, in a message or a tool result) is a 400 naming it; False (default) serves
            the text with a placeholder naming each such block's kind (`omlx.engine.content`).
        test_fault: TEST ONLY, from env ``OMLX_TEST_FAULT`` (never a flag or file key): faults
            to inject into generation (omlx.engine.faults); None in production.
        test_park: TEST ONLY, from env ``OMLX_TEST_PARK``: requests may ask to wait at an await
            point of their route until their client leaves (omlx.api.park); False in production.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = ()
    max_concurrent_requests: int = 8
    max_queued_requests: int = 64
    base_path: str = DEFAULT_BASE_PATH
    hub_cache_dir: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    keepalive_s: float = 5.0
    idle_text_after_s: float | None = 60.0
    preload_blas: bool = True
    log_level: str = "INFO"
    disable_kernels: tuple[str, ...] = ()
    cache: CacheConfig = field(default_factory=CacheConfig)
    aliases: Mapping[str, str] = field(default_factory=dict)
    context_scale_to: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    prefill_step_size: int | None = None
    max_tpot_slowdown: float = 2.0
    lookup_draft_tokens: int = 0
    strict_content: bool = False
    model_settings: Mapping[str, ModelSettings] = field(default_factory=dict)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    test_fault: str | None = None
    test_park: bool = False

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


_ENV_KEYS: dict[str, str] = {
    "OMLX_HOST": "host",
    "OMLX_PORT": "port",
    "OMLX_MODEL": "models",
    "OMLX_MAX_CONCURRENT_REQUESTS": "max_concurrent_requests",
    "OMLX_MAX_QUEUED_REQUESTS": "max_queued_requests",
    "OMLX_BASE_PATH": "base_path",
    "OMLX_API_KEY": "api_key",
    "OMLX_MAX_BODY_BYTES": "max_body_bytes",
    "OMLX_KEEPALIVE_S": "keepalive_s",
    "OMLX_IDLE_TEXT_AFTER_S": "idle_text_after_s",
    "OMLX_CONTEXT_SCALE_TO": "context_scale_to",
    "OMLX_KV_BITS": "kv_bits",
    "OMLX_KV_GROUP_SIZE": "kv_group_size",
    "OMLX_PREFILL_STEP_SIZE": "prefill_step_size",
    "OMLX_LOOKUP_DRAFT_TOKENS": "lookup_draft_tokens",
    "OMLX_MAX_TPOT_SLOWDOWN": "max_tpot_slowdown",
    "OMLX_STRICT_CONTENT": "strict_content",
    "OMLX_PRELOAD_BLAS": "preload_blas",
    "OMLX_LOG_LEVEL": "log_level",
    "OMLX_DISABLE_KERNELS": "disable_kernels",
    "OMLX_BLOCK_SIZE": "cache.block_size",
    "OMLX_HOT_CACHE_MAX_SIZE": "cache.hot_cache_max_bytes",
    "OMLX_CACHE_ENABLED": "cache.enabled",
    "OMLX_SSD_CACHE_DIR": "cache.ssd_cache_dir",
    "OMLX_SSD_CACHE_MAX_SIZE": "cache.ssd_cache_max_bytes",
    "OMLX_SSD_CACHE_ENABLED": "cache.ssd_enabled",
    "OMLX_SSD_WRITE_THROUGH_HITS": "cache.ssd_write_through_hits",
    "OMLX_SSD_WRITE_NEW_BLOCKS": "cache.ssd_write_new_blocks",
    "OMLX_MEMORY_CEILING": "memory.ceiling_bytes",
    "OMLX_CLUSTER_SECRET": "cluster.secret",
    "OMLX_CLUSTER_PEERS": "cluster.peers",
    "OMLX_TEST_FAULT": "test_fault",  # test-only fault injection (omlx.engine.faults)
    "OMLX_TEST_PARK": "test_park",  # test-only parking at a route's await points (omlx.api.park)
}

_FILE_KEYS = {
    "block_size": "cache.block_size",
    "hot_cache_max_size": "cache.hot_cache_max_bytes",
    "enabled": "cache.enabled",
    "ssd_cache_dir": "cache.ssd_cache_dir",
    "ssd_cache_max_size": "cache.ssd_cache_max_bytes",
    "ssd_enabled": "cache.ssd_enabled",
    "ssd_write_through_hits": "cache.ssd_write_through_hits",
    "ssd_write_new_blocks": "cache.ssd_write_new_blocks",
}
_MEMORY_FILE_KEYS = {"ceiling": "memory.ceiling_bytes"}
_CLUSTER_FILE_KEYS = {"memory_cap": "cluster.memory_cap_bytes", "headroom": "cluster.headroom_bytes"}


def _coerce(key: str, value: Any) -> Any:
    name = key.split(".")[-1]
    if name in ("models", "disable_kernels", "peers"):
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return tuple(value)
    if name.endswith("_bytes"):
        return None if value in (None, "") else parse_size(value)
    if name in ("port", "max_concurrent_requests", "max_queued_requests", "block_size",
                "ssd_write_through_hits", "control_port", "worker_port", "context_tokens", "kv_group_size",
                "lookup_draft_tokens"):
        return int(value)
    if name == "kv_bits":
        return None if value in (None, "", "none", "off") else int(value)
    if name == "prefill_step_size":
        return None if value in (None, "", 0, "0", "auto") else int(value)
    if name == "idle_text_after_s":
        return None if value in (None, "", "none", "off") else float(value)
    if name == "context_scale_to":
        return None if value in (None, "", 0, "0") else int(value)
    if name in ("keepalive_s", "max_tpot_slowdown", "soft_watermark", "hard_watermark", "load_wait_s", "check_interval_s",
                "heartbeat_interval_s", "heartbeat_timeout_s", "step_timeout_s"):
        if isinstance(value, bool):  # TOML true would be 1.0: never what was meant
            raise ValueError("a number is needed, not true/false")
        return float(value)
    if name == "headroom_bytes":
        return parse_size(value)
    if name in ("preload_blas", "enabled", "ssd_enabled", "ssd_write_new_blocks", "mdns", "start_workers", "test_park",
                "strict_content"):
        if isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes", "on")
        return bool(value)
    return value


def _flatten_file(data: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k == "cache" and isinstance(v, Mapping):
            for ck, cv in v.items():
                out[_FILE_KEYS.get(ck, f"cache.{ck}")] = cv
        elif k == "memory" and isinstance(v, Mapping):
            for mk, mv in v.items():
                out[_MEMORY_FILE_KEYS.get(mk, f"memory.{mk}")] = mv
        elif k == "cluster" and isinstance(v, Mapping):
            for ck, cv in v.items():
                out[_CLUSTER_FILE_KEYS.get(ck, f"cluster.{ck}")] = cv
        elif k in ("aliases", "models") and isinstance(v, Mapping):
            out["aliases" if k == "aliases" else "model_settings"] = v
        elif k == "model":
            out["models"] = v
        else:
            out[k] = v
    return out


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> ServerConfig:
    """Merge flags > env > file > defaults into a frozen ServerConfig.

    Args:
        flags: values given on the command line (keys as in ServerConfig, ``cache.*`` for the
            cache); None values are ignored.
        env: the environment (defaults to ``os.environ``).
        config_file: TOML path; default ``<base-path>/config.toml`` when it exists.

    Raises:
        InvalidRequestError: on an unknown key, a bad value or an unreadable file.
    """
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None and v != ()}
    env_vals: dict[str, str] = {}
    env_names: dict[str, str] = {}  # setting -> the variable it came from (for errors)
    for k, v in env.items():
        if k in _ENV_KEYS and v != "":
            env_vals[_ENV_KEYS[k]], env_names[_ENV_KEYS[k]] = v, k

    base_path = flags.get("base_path") or env_vals.get("base_path") or DEFAULT_BASE_PATH
    path = config_file or env.get("OMLX_CONFIG")
    if path is None:
        candidate = Path(os.path.expanduser(base_path)) / "config.toml"
        path = candidate if candidate.exists() else None
    file_vals: dict[str, Any] = {}
    if path is not None:
        try:
            file_vals = _flatten_file(tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InvalidRequestError(f"cannot read config file {path}: {e}") from e

    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}  # setting -> where its value came from (for errors)
    aliases: dict[str, Any] = {}
    for source, where in ((file_vals, f"config file {path}"), (env_vals, None), (flags, "the command line")):
        merged.update(source)
        origin.update({k: where or f"environment variable {env_names[k]}" for k in source})
        if isinstance(source.get("aliases"), Mapping):
            aliases.update(source["aliases"])
    if aliases:
        merged["aliases"] = aliases

    top = {f.name for f in fields(ServerConfig)}
    cache_names = {f.name for f in fields(CacheConfig)}
    cfg_kwargs: dict[str, Any] = {}
    cache_kwargs: dict[str, Any] = {}
    memory_names = {f.name for f in fields(MemoryConfig)}
    memory_kwargs: dict[str, Any] = {}
    cluster_names = {f.name for f in fields(ClusterConfig)}
    cluster_kwargs: dict[str, Any] = {}
    for key, value in merged.items():
        try:
            if key.startswith("cache."):
                name = key.split(".", 1)[1]
                if name not in cache_names:
                    raise InvalidRequestError(f"unknown cache setting {name!r}")
                cache_kwargs[name] = _coerce(key, value)
            elif key.startswith("memory."):
                name = key.split(".", 1)[1]
                if name not in memory_names:
                    raise InvalidRequestError(f"unknown memory setting {name!r}")
                memory_kwargs[name] = _coerce(key, value)
            elif key.startswith("cluster."):
                name = key.split(".", 1)[1]
                if name not in cluster_names:
                    raise InvalidRequestError(f"unknown cluster setting {name!r}")
                cluster_kwargs[name] = _coerce(key, value)
            elif key == "aliases":
                cfg_kwargs["aliases"] = {str(a): str(t) for a, t in dict(value).items()}
            elif key == "model_settings":
                cfg_kwargs["model_settings"] = {
                    str(m): parse_model_settings(str(m), s) for m, s in dict(value).items()
                }
            elif key in top:
                cfg_kwargs[key] = _coerce(key, value)
            else:
                raise InvalidRequestError(f"unknown setting {key!r}")
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"bad value for {key}: {value!r} ({e}), from {origin[key]}") from e
    cfg = ServerConfig(**cfg_kwargs)
    if cache_kwargs:
        cfg = replace(cfg, cache=replace(cfg.cache, **cache_kwargs))
    if memory_kwargs:
        cfg = replace(cfg, memory=replace(cfg.memory, **memory_kwargs))
    if cluster_kwargs:
        cfg = replace(cfg, cluster=replace(cfg.cluster, **cluster_kwargs))
    c = cfg.cluster
    if not 0 < c.heartbeat_interval_s < c.heartbeat_timeout_s:
        raise InvalidRequestError("cluster heartbeat_interval_s must be > 0 and below heartbeat_timeout_s")
    m = cfg.memory
    if not 0 < m.soft_watermark <= m.hard_watermark <= 1:
        raise InvalidRequestError("memory watermarks must satisfy 0 < soft_watermark <= hard_watermark <= 1")
    if m.ceiling_bytes is not None and m.ceiling_bytes < 1:
        raise InvalidRequestError("memory ceiling must be a positive size, e.g. 12GB")
    if not 1 <= cfg.max_concurrent_requests <= 1024:
        raise InvalidRequestError("max_concurrent_requests must be between 1 and 1024")
    if cfg.cache.block_size < 1:
        raise InvalidRequestError("block_size must be >= 1")
    if cfg.kv_bits is not None and cfg.kv_bits not in KV_BITS_CHOICES:
        raise InvalidRequestError(f"kv_bits must be one of {', '.join(map(str, KV_BITS_CHOICES))}, got {cfg.kv_bits}")
    if cfg.kv_group_size not in KV_GROUP_SIZE_CHOICES:
        raise InvalidRequestError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZE_CHOICES))}, "
                                  f"got {cfg.kv_group_size}")
    if not math.isfinite(cfg.max_tpot_slowdown) or cfg.max_tpot_slowdown < 0:
        raise InvalidRequestError(f"max_tpot_slowdown must be a number >= 0 (<= 1 turns pacing off), "
                                  f"got {cfg.max_tpot_slowdown}")
    if not 0 <= cfg.lookup_draft_tokens <= 64:
        raise InvalidRequestError(f"lookup_draft_tokens must be 0 (off) to 64, got {cfg.lookup_draft_tokens}")
    if cfg.prefill_step_size is not None and (cfg.prefill_step_size < cfg.cache.block_size
                                              or cfg.prefill_step_size % cfg.cache.block_size):
        raise InvalidRequestError(f"prefill_step_size must be a positive multiple of block_size "
                                  f"({cfg.cache.block_size}), got {cfg.prefill_step_size}")
    if cfg.context_scale_to is not None and cfg.context_scale_to < 1:
        raise InvalidRequestError("context_scale_to must be a positive number of tokens")
    return cfg
