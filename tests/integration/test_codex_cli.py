"""The real Codex CLI (npm @openai/codex, installed by scripts/setup.sh) against omlx serving SmolLM2.

Both run inside a loopback-only network namespace, so nothing can leave the machine. Codex speaks
only the Responses API (always streaming); it needs ``response.output_item.done`` and
``response.completed`` or it retries and fails.
"""

from __future__ import annotations

import pytest

from tests.helpers import MODEL_ID, REPO
from tests.netns import netns_unavailable, run_beside_server

CODEX = REPO / "clients" / "node_modules" / ".bin" / "codex"
PORT = 8123  # any port: the namespace is new and empty

CONFIG = f"""\
model = "{MODEL_ID}"
model_provider = "local"
# Codex's built-in instructions are ~17,000 characters; a 135M model on a CPU prefills a short
# text in seconds instead of minutes, and the test is about the protocol.
model_instructions_file = "{{home}}/instructions.md"

[model_providers.local]
name = "omlx"
base_url = "http://127.0.0.1:{PORT}/v1"
env_key = "OMLX_TEST_KEY"
wire_api = "responses"
"""


def test_codex_exec_says_hi(tmp_path):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    if not CODEX.exists():
        pytest.skip(f"Codex CLI not installed at {CODEX}: run ./scripts/setup.sh (needs npm)")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "instructions.md").write_text("You are a helpful assistant. Answer briefly.\n")
    (home / "config.toml").write_text(CONFIG.replace("{home}", str(home)))
    cmd = [str(CODEX), "exec", "--skip-git-repo-check",
           "-c", "analytics.enabled=false", "-c", "check_for_update_on_startup=false", "-c", "feedback.enabled=false",
           "--disable", "plugins", "--disable", "remote_plugin", "--disable", "apps", "say hi"]
    # Codex sends no temperature; at 1.0 a 135M model sometimes rambles until the output cap (an
    # honest response.incomplete, which Codex reports as an error). Greedy answers "say hi" briefly.
    server_config = tmp_path / "omlx.toml"
    server_config.write_text(f'[models."{MODEL_ID}"]\ndefault_temperature = 0.0\n')
    r = run_beside_server(cmd, port=PORT, cwd=work, env={"CODEX_HOME": str(home), "OMLX_TEST_KEY": "unused"},
                          server_args=["--config", str(server_config)])
    assert r.returncode == 0, f"codex exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-6000:]}"
    assert r.stdout.strip(), f"codex printed no answer\nstderr:\n{r.stderr[-6000:]}"
    assert f"model: {MODEL_ID}" in r.stderr and "provider: local" in r.stderr
    # the answer came from one clean turn: no retries, and usage was read from response.completed
    assert "tokens used" in r.stderr
    assert "Reconnecting" not in r.stderr and "stream disconnected" not in r.stderr, r.stderr[-6000:]
