"""`omlx cluster plan --nodes` (no cluster) and the CLI's refusals, with CliRunner on the real model."""

from __future__ import annotations

import stat
from pathlib import Path

from typer.testing import CliRunner

from omlx.cli.main import app
from omlx.cluster.layer_bytes import read_layout
from tests.helpers import default_model_dir, free_port

runner = CliRunner()


def test_plan_over_hypothetical_nodes(tmp_path: Path) -> None:
    model = str(default_model_dir())
    r = runner.invoke(app, ["cluster", "plan", model, "--nodes", "3GB@20GB/s,4GB@10GB/s",
                            "--base-path", str(tmp_path)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["rank", "node", "layers"]
    assert lines[1].split()[:3] == ["0", "node0", "[0,"] and lines[2].split()[1] == "node1"
    assert lines[2].split()[3].rstrip(")") == str(read_layout(model).num_layers)
    assert "predicted step" in r.output and "even split" in r.output


def test_plan_that_does_not_fit_says_by_how_much(tmp_path: Path) -> None:
    r = runner.invoke(app, ["cluster", "plan", str(default_model_dir()), "--nodes", "2.1GB,2.1GB",
                            "--base-path", str(tmp_path)])
    assert r.exit_code == 1
    assert "GB" in r.output and "short" in r.output.lower(), r.output


def test_plan_rejects_a_bad_spec_and_a_missing_model(tmp_path: Path) -> None:
    r = runner.invoke(app, ["cluster", "plan", str(default_model_dir()), "--nodes", "64GB@fast",
                            "--base-path", str(tmp_path)])
    assert r.exit_code == 2 and "--nodes" in r.output and "fast" in r.output
    r = runner.invoke(app, ["cluster", "plan", "no-such-model", "--nodes", "8GB", "--base-path", str(tmp_path)])
    assert r.exit_code == 2 and "no-such-model" in r.output


def test_status_needs_a_secret_and_an_agent(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OMLX_CLUSTER_SECRET", raising=False)
    r = runner.invoke(app, ["cluster", "status", "--base-path", str(tmp_path)])
    assert r.exit_code == 2 and "secret" in r.output
    r = runner.invoke(app, ["cluster", "status", "--base-path", str(tmp_path), "--secret", "a-good-secret",
                            "--control-port", str(free_port())])
    assert r.exit_code == 1 and "cannot connect" in r.output


def test_secret_file_is_private(tmp_path: Path) -> None:
    from omlx.cli.cluster import resolve_secret
    from omlx.config import load_config

    cfg = load_config({"base_path": str(tmp_path)}, env={})
    assert resolve_secret(cfg, "a-good-secret", persist=True) == b"a-good-secret"
    path = tmp_path / "cluster" / "secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip() == "a-good-secret"
    assert resolve_secret(cfg, None) == b"a-good-secret"  # status/leave find it later


def test_worker_command_is_registered_and_refuses_a_bad_rank(tmp_path: Path) -> None:
    # The node agent's launcher runs `omlx cluster worker ...`: the command must exist there.
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"]]')
    r = runner.invoke(app, ["cluster", "worker", "--model", str(default_model_dir()), "--ranges", "0:10,10:30",
                            "--rank", "5", "--hostfile", str(hostfile)])
    assert r.exit_code != 0
    assert "rank" in (r.output + str(r.exception)).lower()
