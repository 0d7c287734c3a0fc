"""The real Claude Code CLI (npm @anthropic-ai/claude-code, installed by scripts/setup.sh) against
omlx serving SmolLM2, both inside a loopback-only network namespace so nothing can leave the machine.

Claude Code speaks the Anthropic Messages API: ``HEAD /``, then a streamed ``POST /v1/messages?beta=true``
with its tools, ``thinking: adaptive`` and ``max_tokens: 32000``. It asks for model ids of its own
(here ``local-model``), so the server maps them with an alias; it sends the key as ``x-api-key``.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import MODEL_ID, REPO
from tests.netns import netns_unavailable, run_beside_server

CLAUDE = REPO / "clients" / "node_modules" / ".bin" / "claude"
PORT = 8124  # any port: the namespace is new and empty
KEY = "sk-omlx-claude-code-test"
CLIENT_MODEL = "local-model"


def test_claude_code_print_says_hi(tmp_path):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    if not CLAUDE.exists():
        pytest.skip(f"Claude Code not installed at {CLAUDE}: run ./scripts/setup.sh (needs npm)")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    config = tmp_path / "omlx.toml"
    # The server is configured by file: the API key, the alias for Claude Code's model id, greedy
    # decoding where the request names no temperature (Claude Code's main loop does not) and an
    # output cap: SmolLM2 at temperature 1 can ramble for thousands of tokens, and Claude Code
    # gives up after three "max_tokens" continuations. The test is about the protocol.
    config.write_text(f'api_key = "{KEY}"\n[aliases]\n"{CLIENT_MODEL}" = "{MODEL_ID}"\n'
                      f'[models."{MODEL_ID}"]\ndefault_temperature = 0.0\nmax_output_tokens = 200\n')
    env = {
        "OMLX_CONFIG": str(config),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{PORT}",
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_AUTH_TOKEN": "",
        "ANTHROPIC_MODEL": CLIENT_MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": CLIENT_MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    # Claude Code's own system prompt is ~6,000 characters: a 135M model on a CPU prefills a short
    # one in seconds instead of minutes. Three of its tools are still sent (with the Agent tool it
    # also adds a long list of agent types that sends greedy SmolLM2 into a loop).
    cmd = [str(CLAUDE), "-p", "say hi", "--output-format", "json", "--no-session-persistence",
           "--system-prompt", "You are a helpful assistant. Answer briefly.", "--tools", "Bash,Read,Edit"]
    r = run_beside_server(cmd, port=PORT, cwd=work, env=env, timeout_s=600)
    assert r.returncode == 0, f"claude exited {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-6000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["type"] == "result" and out["subtype"] == "success" and out["is_error"] is False, out
    assert isinstance(out["result"], str) and out["result"].strip(), out
    assert out["num_turns"] == 1 and out["stop_reason"] == "end_turn", out  # one clean turn, no continuation
    # the text came from omlx: usage is what the server reported for the model id Claude Code asked for
    usage = out["modelUsage"][CLIENT_MODEL]
    assert usage["inputTokens"] + usage["cacheReadInputTokens"] > 0 and usage["outputTokens"] > 0, out
