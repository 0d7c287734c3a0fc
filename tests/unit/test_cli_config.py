"""`omlx serve` refuses a bad configuration before it loads anything: exit code 2 and one line
naming the source, the key as the user wrote it (TOML key, ``OMLX_*`` variable, ``--flag``) and
what was expected (CliRunner; every case here fails, so no server starts)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from omlx.cli.common import warn_unknown_env
from omlx.cli.main import app

runner = CliRunner()


def _serve(tmp_path: Path, args: list[str], env: dict[str, str] | None = None, config: str | None = None) -> str:
    if config is not None:
        (tmp_path / "config.toml").write_text(config)  # <base-path>/config.toml, read by default
    r = runner.invoke(app, ["serve", "--base-path", str(tmp_path), *args], env=env)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("omlx: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


@pytest.mark.parametrize("args, env, config, want", [
    (["--port", "70000"], None, None, "omlx: bad value for --port: 70000 (expected an integer from 1 to 65535), from the command line"),
    (["--port", "0"], None, None, "omlx: bad value for --port: 0 (expected an integer from 1 to 65535), from the command line"),
    ([], {"OMLX_PORT": "65536"}, None, "omlx: bad value for OMLX_PORT: '65536' (expected an integer from 1 to 65535), from the environment"),
    (["--log-level", "LOUD"], None, None, "omlx: bad value for --log-level: 'LOUD' (expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL), from the command line"),
    (["--max-tpot-slowdown", "-1"], None, None, "omlx: bad value for --max-tpot-slowdown: -1.0 (expected a number >= 0), from the command line"),
    (["--memory-ceiling", "lots"], None, None, "omlx: bad value for --memory-ceiling: 'lots' (not a byte size: 'lots' (use e.g. 512MB, 8GB)), from the command line"),
    ([], {"OMLX_MAX_TPOT_SLOWDOWN": "fast"}, None, "omlx: bad value for OMLX_MAX_TPOT_SLOWDOWN: 'fast' (expected a number), from the environment"),
    # a value the option's type refuses (Typer checks it first) reads like the config's own errors
    (["--port", "abc"], None, None, "omlx: bad value for --port: 'abc' (expected an integer), from the command line"),
    (["--max-tpot-slowdown=fast"], None, None, "omlx: bad value for --max-tpot-slowdown: 'fast' (expected a number), from the command line"),
])
def test_serve_names_the_flag_or_variable_and_exits_2(tmp_path: Path, args: list[str], env: dict[str, str] | None,
                                                      config: str | None, want: str):
    assert _serve(tmp_path, args, env, config) == want


def test_serve_refuses_a_bad_file_value_that_a_flag_overrides(tmp_path: Path):
    line = _serve(tmp_path, ["--port", "8123"], config="port = 99999\n")
    assert line == (f"omlx: bad value for port: 99999 (expected an integer from 1 to 65535), "
                    f"from config file {tmp_path / 'config.toml'}")


def test_every_command_answers_a_mistyped_option_value_in_one_line(tmp_path: Path):
    r = runner.invoke(app, ["start", "--base-path", str(tmp_path), "--port", "abc"])
    assert (r.exit_code, r.output) == (2, "omlx: bad value for --port: 'abc' (expected an integer), from the command line\n")
    r = runner.invoke(app, ["serve", "--bogus"])  # not a value: Typer's usage message, still exit 2
    assert r.exit_code == 2 and "No such option: --bogus" in r.output


def test_serve_says_a_config_path_that_is_a_directory_is_one(tmp_path: Path):
    line = _serve(tmp_path, ["--config", str(tmp_path)])
    assert line == (f"omlx: cannot read config file {tmp_path}: it is a directory "
                    f"(name the file, e.g. {tmp_path / 'config.toml'})")


def test_serve_refuses_a_bad_per_model_number_and_an_unknown_tool_dialect(tmp_path: Path):
    line = _serve(tmp_path, [], config='[models."smol"]\nmax_output_tokens = -1\n')
    assert line.startswith('omlx: bad value for models."smol".max_output_tokens: -1 (expected an integer from 1 to 2147483647), from config file')
    line = _serve(tmp_path, [], config='[models."smol"]\ntool_dialect = "hermess"\n')
    assert line.startswith("omlx: bad value for models.\"smol\".tool_dialect: 'hermess' (unknown tool dialect 'hermess'; "
                           "use one of: ") and "hermes" in line


def test_unknown_omlx_variables_are_warned_once_with_a_suggestion(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture):
    monkeypatch.setenv("OMLX_MAX_CONCURENT_REQUESTS", "4")
    with caplog.at_level(logging.WARNING):
        warn_unknown_env()
    got = [r.getMessage() for r in caplog.records if "OMLX_MAX_CONCURENT_REQUESTS" in r.getMessage()]
    assert got == ["environment variable OMLX_MAX_CONCURENT_REQUESTS is not an omlx setting and is ignored "
                   "(did you mean OMLX_MAX_CONCURRENT_REQUESTS?)"]


@pytest.mark.parametrize("args, want", [
    (["--memory-cap", "lots"], "omlx: bad value for --memory-cap: 'lots' (not a byte size: 'lots' (use e.g. 512MB, 8GB)), from the command line"),
    (["--peer", "a:0"], "omlx: bad value for --peer: ('a:0',) (peer 'a:0': expected host or host:port, the port from 1 to 65535), from the command line"),
    (["--control-port", "65536"], "omlx: bad value for --control-port: 65536 (expected an integer from 1 to 65535), from the command line"),
    (["--log-level", "LOUD"], "omlx: bad value for --log-level: 'LOUD' (expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL), from the command line"),
])
def test_cluster_join_names_its_own_flags(tmp_path: Path, args: list[str], want: str):
    r = runner.invoke(app, ["cluster", "join", "--base-path", str(tmp_path), *args])
    assert r.exit_code == 2 and r.output.strip() == want, r.output
