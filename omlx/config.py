"""Configuration: frozen dataclasses built once, at the edge.

Precedence, highest first: command-line flags > ``OMLX_*`` environment variables > the TOML
file (``--config``, default ``<base-path>/config.toml``) > defaults. Environment variables are
read here and nowhere else.

TOML layout::

    host = "127.0.0.1"
    port = 8000
    model = "SmolLM2-135M-Instruct"
    max_concurrent_requests = 8
    api_key = "..."
    [cache]
    block_size = 256
    hot_cache_max_size = "2GB"
    [aliases]
    "claude-haiku-4-5" = "SmolLM2-135M-Instruct"
    [models."SmolLM2-135M-Instruct"]
    context_length = 8192
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Per-model settings from the ``[models."<id>"]`` TOML tables."""

    context_length: int | None = None
    tool_dialect: str | None = None
    default_temperature: float | None = None
    default_max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """KV cache tiers.

    Attributes:
        block_size: tokens per KV block.
        hot_cache_max_bytes: RAM budget of the hot tier; None = derived from memory at start.
        enabled: False turns the prefix cache off (for A/B runs).
        ssd_cache_dir: cold tier folder; None = ``<base-path>/cache``.
        ssd_cache_max_bytes: disk budget; None = a bounded fraction of free disk.
    """

    block_size: int = 256
    hot_cache_max_bytes: int | None = None
    enabled: bool = True
    ssd_cache_dir: str | None = None
    ssd_cache_max_bytes: int | None = None
    ssd_enabled: bool = True


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `omlx serve` needs; built once by the CLI.

    Attributes:
        host, port: where to listen.
        models: model ids or paths to load at start (the first is the default).
        max_concurrent_requests: requests decoding at once per model.
        max_queued_requests: requests waiting beyond that before a 429.
        base_path: omlx's home (models, cache, config).
        api_key: required on every route when set.
        max_body_bytes: larger request bodies get a 413.
        keepalive_s: SSE keep-alive period while a prompt is prefilled.
        preload_blas: re-exec with OpenBLAS preloaded on Linux when MLX would use reference BLAS.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = ()
    max_concurrent_requests: int = 8
    max_queued_requests: int = 64
    base_path: str = DEFAULT_BASE_PATH
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    keepalive_s: float = 5.0
    preload_blas: bool = True
    log_level: str = "INFO"
    cache: CacheConfig = field(default_factory=CacheConfig)
    aliases: Mapping[str, str] = field(default_factory=dict)
    model_settings: Mapping[str, ModelSettings] = field(default_factory=dict)

    @property
    def base_dir(self) -> Path:
        return Path(os.path.expanduser(self.base_path))

    @property
    def models_dir(self) -> Path:
        return self.base_dir / "models"

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
    "OMLX_PRELOAD_BLAS": "preload_blas",
    "OMLX_LOG_LEVEL": "log_level",
    "OMLX_BLOCK_SIZE": "cache.block_size",
    "OMLX_HOT_CACHE_MAX_SIZE": "cache.hot_cache_max_bytes",
    "OMLX_CACHE_ENABLED": "cache.enabled",
    "OMLX_SSD_CACHE_DIR": "cache.ssd_cache_dir",
    "OMLX_SSD_CACHE_MAX_SIZE": "cache.ssd_cache_max_bytes",
    "OMLX_SSD_CACHE_ENABLED": "cache.ssd_enabled",
}

_FILE_KEYS = {
    "block_size": "cache.block_size",
    "hot_cache_max_size": "cache.hot_cache_max_bytes",
    "enabled": "cache.enabled",
    "ssd_cache_dir": "cache.ssd_cache_dir",
    "ssd_cache_max_size": "cache.ssd_cache_max_bytes",
    "ssd_enabled": "cache.ssd_enabled",
}


def _coerce(key: str, value: Any) -> Any:
    name = key.split(".")[-1]
    if name == "models":
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return tuple(value)
    if name.endswith("_bytes"):
        return None if value in (None, "") else parse_size(value)
    if name in ("port", "max_concurrent_requests", "max_queued_requests", "block_size"):
        return int(value)
    if name == "keepalive_s":
        return float(value)
    if name in ("preload_blas", "enabled", "ssd_enabled"):
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
    env_vals = {_ENV_KEYS[k]: v for k, v in env.items() if k in _ENV_KEYS and v != ""}

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
    for source in (file_vals, env_vals, flags):
        merged.update(source)

    top = {f.name for f in fields(ServerConfig)}
    cache_names = {f.name for f in fields(CacheConfig)}
    cfg_kwargs: dict[str, Any] = {}
    cache_kwargs: dict[str, Any] = {}
    for key, value in merged.items():
        try:
            if key.startswith("cache."):
                name = key.split(".", 1)[1]
                if name not in cache_names:
                    raise InvalidRequestError(f"unknown cache setting {name!r}")
                cache_kwargs[name] = _coerce(key, value)
            elif key == "aliases":
                cfg_kwargs["aliases"] = {str(a): str(t) for a, t in dict(value).items()}
            elif key == "model_settings":
                cfg_kwargs["model_settings"] = {
                    str(m): ModelSettings(**dict(s)) for m, s in dict(value).items()
                }
            elif key in top:
                cfg_kwargs[key] = _coerce(key, value)
            else:
                raise InvalidRequestError(f"unknown setting {key!r}")
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"bad value for {key}: {value!r} ({e})") from e
    cfg = ServerConfig(**cfg_kwargs)
    if cache_kwargs:
        cfg = replace(cfg, cache=replace(cfg.cache, **cache_kwargs))
    if not 1 <= cfg.max_concurrent_requests <= 1024:
        raise InvalidRequestError("max_concurrent_requests must be between 1 and 1024")
    if cfg.cache.block_size < 1:
        raise InvalidRequestError("block_size must be >= 1")
    return cfg
