"""`omlx launch claude|codex|opencode [-- ARGS]`: find or start the server, then run the client set up for it.

The server is the one answering ``/health`` at the configured host and port; when none does,
``omlx serve`` is started in the background as ``omlx start --backend pidfile`` would
(`omlx.cli.service`: its own session, so it outlives the client; log
``<base>/logs/serve-<port>.log``, pid ``<base>/run/serve-<port>.pid``; ``omlx status|stop`` see it). The model is ``--model``,
else the server's default (the first of ``/v1/models``). Then the client replaces this process
(``os.execvpe``) with:

- **claude** (Claude Code): ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY`` (the server's key, or a
  placeholder when it has none; ``ANTHROPIC_AUTH_TOKEN`` emptied), ``ANTHROPIC_MODEL`` and
  ``ANTHROPIC_DEFAULT_HAIKU_MODEL`` = the served id, telemetry, auto-update and other
  non-essential traffic off, ``CLAUDE_CODE_ATTRIBUTION_HEADER=0`` (the per-request attribution
  text would change the prompt's first block and defeat the prefix cache), and the timeouts
  that let a long first prefill finish (``CLAUDE_STREAM_IDLE_TIMEOUT_MS``, ``API_TIMEOUT_MS``:
  30 min; README, *Long first prompts*). The user's ``~/.claude`` is not touched.
- **codex** (Codex CLI): a private ``CODEX_HOME`` (``<base>/launch/codex``) whose
  ``config.toml`` names an ``omlx`` provider (``wire_api = "responses"``, the served id as the
  model); the user's ``~/.codex`` is not read or written.
- **opencode**: ``OPENCODE_CONFIG`` pointing at ``<base>/launch/opencode.json`` (an
  OpenAI-compatible provider ``omlx`` with the served model).

``--print-env`` prints what would be set (and the config file written) and starts nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from omlx.cli.common import config_from

#: client -> (executable, how to install it)
CLIENTS = {
    "claude": ("claude", "npm install -g @anthropic-ai/claude-code"),
    "codex": ("codex", "npm install -g @openai/codex"),
    "opencode": ("opencode", "npm install -g opencode-ai"),
}
PLACEHOLDER_KEY = "omlx-local"
#: The clients' stream-idle and request timeouts for long first prefills: Claude Code's
#: (README: values below 300 s are ignored by the CLI; 600 s was measured to be honoured) and
#: Codex's provider ``stream_idle_timeout_ms`` (its default 300000).
CLIENT_TIMEOUT_MS = "1800000"


def launch(
    client: Annotated[str, typer.Argument(help="claude, codex or opencode.")],
    args: Annotated[Optional[list[str]], typer.Argument(help="Arguments for the client (after --).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Served model id (default: the server's default).")] = None,
    host: Annotated[Optional[str], typer.Option(help="Server address (default from config, 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Server port (default from config, 8000).")] = None,
    base_path: Annotated[Optional[str], typer.Option(help="omlx's home (default ~/.omlx).")] = None,
    config: Annotated[Optional[str], typer.Option("--config", help="TOML config file.")] = None,
    print_env: Annotated[bool, typer.Option("--print-env", help="Print the settings the client would get; start nothing.")] = False,
    client_path: Annotated[Optional[str], typer.Option(help="The client's executable (default: found on PATH).")] = None,
    wait_s: Annotated[float, typer.Option(help="Most seconds to wait for a server this command starts.")] = 600.0,
) -> None:
    if client not in CLIENTS:
        typer.echo(f"omlx launch: unknown client {client!r}; expected one of {', '.join(CLIENTS)}", err=True)
        raise typer.Exit(2)
    cfg = config_from({"host": host, "port": port, "base_path": base_path}, config)
    url = f"http://{'127.0.0.1' if cfg.host in ('0.0.0.0', '::', '') else cfg.host}:{cfg.port}"
    key = cfg.api_key or PLACEHOLDER_KEY
    exe = None
    if not print_env:
        exe = client_path or shutil.which(CLIENTS[client][0])
        if not exe or not os.access(exe, os.X_OK):
            typer.echo(f"omlx launch: {CLIENTS[client][0]} is not installed (not found on PATH); install it with "
                       f"`{CLIENTS[client][1]}`, or give its path with --client-path", err=True)
            raise typer.Exit(2)
        ensure_server(url, key, cfg, model, config, wait_s)
        served = served_model(url, key, model)
    else:
        served = model or (cfg.models[0] if cfg.models else default_model_id())
    env, files = client_settings(client, url, key, served, cfg.base_dir)
    if print_env:
        for k, v in env.items():
            typer.echo(f"{k}={v}")
        for path, text in files.items():
            typer.echo(f"# {path}\n{text}")
        raise typer.Exit(0)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert exe is not None
    os.execvpe(exe, [exe, *(args or [])], {**os.environ, **env})


def default_model_id() -> str:
    from omlx.engine.embedded import DEFAULT_MODEL_ID

    return DEFAULT_MODEL_ID


def client_settings(client: str, url: str, key: str, model: str, base: Path) -> tuple[dict[str, str], dict[Path, str]]:
    """(environment, files to write) that point ``client`` at the server ``url`` serving ``model``."""
    if client == "claude":
        return {
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": key,
            "ANTHROPIC_AUTH_TOKEN": "",
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": CLIENT_TIMEOUT_MS,
            "API_TIMEOUT_MS": CLIENT_TIMEOUT_MS,
        }, {}
    if client == "codex":
        home = base / "launch" / "codex"
        text = (f'model = "{model}"\nmodel_provider = "omlx"\n\n[model_providers.omlx]\nname = "omlx"\n'
                f'base_url = "{url}/v1"\nenv_key = "OMLX_LAUNCH_API_KEY"\nwire_api = "responses"\n'
                # a long first prefill sends no output for minutes (Codex's default is 300000)
                f'stream_idle_timeout_ms = {CLIENT_TIMEOUT_MS}\n')
        return {"CODEX_HOME": str(home), "OMLX_LAUNCH_API_KEY": key}, {home / "config.toml": text}
    path = base / "launch" / "opencode.json"
    conf = {"$schema": "https://opencode.ai/config.json", "model": f"omlx/{model}",
            "provider": {"omlx": {"npm": "@ai-sdk/openai-compatible", "name": "omlx",
                                  "options": {"baseURL": f"{url}/v1", "apiKey": key},
                                  "models": {model: {"name": model}}}}}
    return {"OPENCODE_CONFIG": str(path)}, {path: json.dumps(conf, indent=2) + "\n"}


def _get(url: str, key: str, timeout_s: float = 2.0) -> Any:
    import httpx

    r = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def server_up(url: str, key: str) -> bool:
    try:
        _get(url + "/health", key)
        return True
    except Exception:
        return False


def ensure_server(url: str, key: str, cfg: Any, model: str | None, config: str | None, wait_s: float) -> None:
    """Use the server at ``url``, or start ``omlx serve`` in the background (the pidfile backend
    of `omlx.cli.service`: record, pid file and log as ``omlx start`` writes them, so ``omlx
    status|stop`` see it) and wait for it.

    Raises:
        typer.Exit: the started server exited or did not answer within ``wait_s`` (its log tail
            is printed).
    """
    from omlx.cli.service import build_spec, start_service
    from omlx.cli.service_backends import PidfileBackend, ServiceError

    if server_up(url, key):
        typer.echo(f"omlx launch: using the server at {url}", err=True)
        return
    spec = build_spec(cfg, {"model": [model] if model else None, "config": config}, "pidfile")

    def say(text: str) -> None:
        typer.echo(f"omlx launch: {text}", err=True)

    try:
        start_service(spec, PidfileBackend(), cfg, wait_s, say)
    except ServiceError as e:
        say(str(e))
        raise typer.Exit(1) from e


def served_model(url: str, key: str, model: str | None) -> str:
    """``model`` if the server serves it (or can load it), else the server's default id.

    Raises:
        typer.Exit: the server lists no model, or not ``model``.
    """
    ids = [m["id"] for m in _get(url + "/v1/models", key, timeout_s=30).get("data", [])]
    if model is None:
        if not ids:
            typer.echo(f"omlx launch: the server at {url} serves no model", err=True)
            raise typer.Exit(1)
        return ids[0]
    if model not in ids:
        typer.echo(f"omlx launch: the server at {url} does not serve {model!r}; it serves: {', '.join(ids)}", err=True)
        raise typer.Exit(1)
    return model
