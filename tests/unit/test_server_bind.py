"""A port taken while the models loaded (after `check_bind` found it free) ends the start with one
line and exit code 2, as a busy port found at the start does; "ready" is logged only once the
socket is bound, so it never comes before such a refusal. Found by a fresh-user check: the
server logged "omlx ready", then died with a Sanic traceback."""

from __future__ import annotations

import logging
import socket

from omlx.api.server import run_app, startup_status
from omlx.config import load_config
from omlx.pool import EnginePool


def test_a_port_taken_while_loading_is_one_line_and_exit_2(tmp_path, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config({"base_path": str(tmp_path), "port": port, "host": "127.0.0.1"}, env={})
        pool = EnginePool(cfg)  # no model: run_app only builds the app and binds
        with caplog.at_level(logging.INFO, logger="omlx"):
            code = run_app(cfg, pool, startup_status(cfg), "omlx ready on test")
    assert code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(f"port {port}" in m and "pick another with --port" in m for m in errors), errors
    assert not any("omlx ready on test" in r.getMessage() for r in caplog.records)
