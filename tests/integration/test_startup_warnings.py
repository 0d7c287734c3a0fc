"""No silent slow paths: a real `omlx serve` reports native kernels in /health, and a kernel
forced off (``OMLX_DISABLE_KERNELS``) gives a warning in the log and in /health."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import ServerProcess


def test_forced_missing_kernel_is_warned_in_log_and_health(tmp_path):
    with ServerProcess(base_path=tmp_path / "home", env={"OMLX_DISABLE_KERNELS": "kv_gather"}) as s:
        body = httpx.get(s.url + "/health", timeout=10).json()
        log = s.log()
    kernels = body["kernels"]
    assert kernels["kv_gather"]["path"] == "reference"
    assert "disabled by configuration" in kernels["kv_gather"]["reason"]
    lines = [m for m in body["slow_paths"] if "kv_gather" in m]
    assert lines and "OMLX_DISABLE_KERNELS" in lines[0], body["slow_paths"]
    assert "SLOW PATH" in log and "native kernel kv_gather" in log, log[-3000:]


def test_health_reports_kernels_without_warning_by_default(server):
    body = httpx.get(server.url + "/health", timeout=10).json()
    k = body["kernels"]["kv_gather"]
    assert set(k) >= {"available", "path", "backend", "reason", "slow", "warning", "fix", "native_build"}
    # On this CPU machine the reference path is the fast path: nothing to warn about.
    if k["backend"] == "cpu":
        assert (k["path"], k["slow"], k["warning"]) == ("reference", False, "")
        assert not any("kv_gather" in m for m in body["slow_paths"])


def test_a_model_without_a_tool_call_format_is_warned_at_load(server):
    """SmolLM2's template has no tool-call format: tools would silently come back as text."""
    log = server.log_path.read_text()  # the whole log: the line is written at start
    assert "SmolLM2-135M-Instruct: no tool-call format detected" in log, log[-3000:]


def test_a_models_table_for_no_model_is_warned_at_start_with_the_closest_id(tmp_path):
    """``[models."<id>"]`` for an id omlx cannot find (a typo) was accepted silently: its settings
    never applied. Not an error (the model may be pulled later), but a warning naming it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[models."SmolLM2-135M-Instuct"]\ncontext_length = 4096\n'  # the typo
        '[models."SmolLM2-135M-Instruct"]\ncontext_length = 4096\n'  # the served model: no warning
        f'[models."elsewhere"]\npath = "{tmp_path / "gone"}"\n')
    with ServerProcess(base_path=home, env={"COLUMNS": "1000"}) as s:  # rich wraps log lines at the width
        log = s.log_path.read_text()
    assert ('[models."SmolLM2-135M-Instuct"] in the config names no model omlx can find' in log
            and "(did you mean SmolLM2-135M-Instruct?)" in log), log[-3000:]
    assert f'[models."elsewhere"] in the config: its path {tmp_path / "gone"} does not exist' in log, log[-3000:]
    assert '[models."SmolLM2-135M-Instruct"] in the config' not in log, log[-3000:]


def test_a_pinned_model_that_does_not_exist_refuses_the_start_naming_the_closest_id(tmp_path):
    """``pin = true`` for an id omlx cannot find started the default model and then failed loading
    the pinned one, with no word of the id meant."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('[models."SmolLM2-135M-Instuct"]\npin = true\n')  # the typo
    s = ServerProcess(base_path=home, env={"COLUMNS": "1000"})
    try:
        with pytest.raises(RuntimeError, match="exited with 1") as ei:
            s.start(timeout_s=300)
    finally:
        s.stop()
    log = " ".join(str(ei.value).split())
    assert ("cannot start: The model 'SmolLM2-135M-Instuct' does not exist: [models.\"SmolLM2-135M-Instuct\"] in the "
            "config has pin = true" in log and "(did you mean SmolLM2-135M-Instruct?)" in log), log[-3000:]
    assert "in the config names no model omlx can find" not in log, log[-3000:]  # one message, the error
