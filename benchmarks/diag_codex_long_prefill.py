"""The real Codex CLI against the real `omlx serve` through a long prefill, with its stream idle
watchdog set short (issue 27): do omlx's Responses keep-alives keep it on one attempt?

Runs ``codex exec`` with a ~4.7k-token prompt against SmolLM2 (prefix cache off, so every
attempt prefills from nothing; greedy, output capped at 120 tokens) in a loopback-only namespace
(`tests/netns.py`), with the provider's ``stream_idle_timeout_ms = 8000`` and omlx's
``keepalive_s = 2``. The argument is ``OMLX_IDLE_TEXT_AFTER_S``: ``off`` (SSE comments only) or
``0`` (``response.in_progress`` events from the start). Prints the exit code, wall time and the
CLI's output; "Reconnecting... N/5" lines are attempts its watchdog cut.
Usage (as root): python benchmarks/diag_codex_long_prefill.py off|0
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import MODEL_ID  # noqa: E402
from tests.netns import run_beside_server  # noqa: E402

PORT = 8127
CONFIG = f"""\
model = "{MODEL_ID}"
model_provider = "local"
model_instructions_file = "{{home}}/instructions.md"

[model_providers.local]
name = "omlx"
base_url = "http://127.0.0.1:{PORT}/v1"
env_key = "OMLX_TEST_KEY"
wire_api = "responses"
stream_idle_timeout_ms = 8000
"""


def main() -> None:
    idle_after = sys.argv[1] if len(sys.argv) > 1 else "0"
    with tempfile.TemporaryDirectory() as tmp:
        home, work = Path(tmp) / "codex-home", Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        (home / "instructions.md").write_text("You are a helpful assistant. Answer briefly.\n")
        (home / "config.toml").write_text(CONFIG.replace("{home}", str(home)))
        server_config = Path(tmp) / "omlx.toml"
        server_config.write_text(f'[models."{MODEL_ID}"]\ndefault_temperature = 0.0\nmax_output_tokens = 120\n')
        text = f"Run {uuid.uuid4().hex}. " + " ".join(f"Item {i} is a small red box on shelf {i % 17}." for i in range(260))
        cmd = [str(REPO / "clients" / "node_modules" / ".bin" / "codex"), "exec", "--skip-git-repo-check",
               "-c", "analytics.enabled=false", "-c", "check_for_update_on_startup=false", "-c", "feedback.enabled=false",
               "--disable", "plugins", "--disable", "remote_plugin", "--disable", "apps",
               "How many items are listed? " + text]
        t0 = time.monotonic()
        r = run_beside_server(cmd, port=PORT, cwd=work, timeout_s=900,
                              env={"CODEX_HOME": str(home), "OMLX_TEST_KEY": "unused", "OMLX_KEEPALIVE_S": "2",
                                   "OMLX_IDLE_TEXT_AFTER_S": idle_after},
                              server_args=["--no-cache", "--config", str(server_config)])
    print(f"OMLX_IDLE_TEXT_AFTER_S={idle_after} rc={r.returncode} wall_s={time.monotonic() - t0:.1f}")
    print(r.stdout[-500:])
    print(r.stderr.split("--- omlx serve log ---")[0][-3000:])


if __name__ == "__main__":
    main()
