"""`omlx doctor`: the JSON schema, exit codes, and that every problem comes with its fix."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from typer.testing import CliRunner

from omlx.cli.main import app
from omlx.config import load_config
from omlx.kernels import doctor

runner = CliRunner()

FINDING_KEYS = {"check", "level", "summary", "fix", "detail"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _doctor(tmp_path: Path, *args: str):
    r = runner.invoke(app, ["doctor", "--json", "--base-path", str(tmp_path / "home"), *args])
    return r, json.loads(r.stdout)


def test_json_schema(tmp_path):
    r, report = _doctor(tmp_path, "--port", str(_free_port()))
    assert set(report) == {"schema_version", "omlx", "ok", "num_errors", "num_warnings", "findings"}
    assert report["schema_version"] == doctor.SCHEMA_VERSION == 1
    assert [f["check"] for f in report["findings"]] == list(doctor.CHECKS)
    for f in report["findings"]:
        assert set(f) == FINDING_KEYS
        assert f["level"] in doctor.LEVELS and f["summary"]
        assert isinstance(f["detail"], dict)
        if f["level"] in ("warning", "error"):
            assert f["fix"], f"{f['check']}: a problem without its fix"
    assert report["num_errors"] == sum(f["level"] == "error" for f in report["findings"])
    assert report["ok"] == (report["num_errors"] == 0)
    assert r.exit_code == (0 if report["ok"] else 1)
    by = {f["check"]: f for f in report["findings"]}
    assert by["kernels"]["detail"]["kernels"]["kv_gather"]["path"] in ("reference", "cuda", "metal")
    assert by["blas"]["detail"]["name"] in ("accelerate", "openblas", "reference", "unknown")
    assert by["mlx"]["detail"]["mlx"]
    assert by["memory"]["detail"]["ceiling_bytes"] > 0


def test_busy_port_is_an_error_with_its_fix(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r, report = _doctor(tmp_path, "--port", str(port))
    assert r.exit_code == 1 and not report["ok"]
    port_finding = next(f for f in report["findings"] if f["check"] == "port")
    assert port_finding["level"] == "error" and "already in use" in port_finding["summary"]
    assert "--port" in port_finding["fix"]


def test_missing_configured_model_is_an_error(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text('model = "no-such-model"\n')
    r, report = _doctor(tmp_path, "--port", str(_free_port()))
    models = next(f for f in report["findings"] if f["check"] == "models")
    assert r.exit_code == 1 and models["level"] == "error" and "no-such-model" in models["summary"]
    assert "omlx models import" in models["fix"]


def test_disabled_kernel_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_DISABLE_KERNELS", "kv_gather")
    try:
        _, report = _doctor(tmp_path, "--port", str(_free_port()))
    finally:
        from omlx.kernels.status import native_kernel_status

        native_kernel_status(refresh=True)
    k = next(f for f in report["findings"] if f["check"] == "kernels")
    assert k["level"] in ("info", "warning") and "disabled" in k["summary"] and "OMLX_DISABLE_KERNELS" in k["fix"]


def test_human_output_and_exit_code(tmp_path):
    r = runner.invoke(app, ["doctor", "--base-path", str(tmp_path / "home"), "--port", str(_free_port())])
    assert "platform" in r.stdout and "kernels" in r.stdout
    assert r.exit_code in (0, 1)
    assert ("not ready" in r.stdout) == (r.exit_code == 1)


def test_a_crashing_check_becomes_an_error(tmp_path, monkeypatch):
    def boom(cfg, facts):
        raise RuntimeError("probe exploded")

    monkeypatch.setitem(doctor._CHECKS, "disk", boom)
    cfg = load_config({"base_path": str(tmp_path)}, env={})
    report = doctor.run_checks(cfg, doctor.Facts(memory_ceiling_bytes=8 * 10**9, bind_problem=None))
    disk = next(f for f in report.findings if f.check == "disk")
    assert disk.level == "error" and "probe exploded" in disk.summary and report.exit_code == 1


def test_low_disk_and_memory_verdicts(tmp_path, monkeypatch):
    cfg = load_config({"base_path": str(tmp_path)}, env={})
    facts = doctor.Facts(memory_ceiling_bytes=10**15, bind_problem=None)
    assert doctor.check_memory(cfg, facts).level == "warning"

    class Usage:
        free = 10**8

    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: Usage)
    f = doctor.check_disk(cfg, facts)
    assert f.level == "error" and f.fix


def test_serve_blas_reports_the_preload(monkeypatch):
    from omlx.kernels import blas

    monkeypatch.setattr(doctor.sys, "platform", "linux")
    monkeypatch.setattr(blas, "detect_blas", lambda: blas.BlasStatus("reference", "/x/libblas.so.3", False, "slow"))
    monkeypatch.setattr(blas, "find_openblas", lambda: "/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
    b = doctor.serve_blas(preload_blas=True)
    assert (b["name"], b["fast"], b["preloaded_by_serve"]) == ("openblas", True, True)
    assert b["this_process"]["name"] == "reference"
    b = doctor.serve_blas(preload_blas=False)
    assert b["name"] == "reference" and not b["fast"] and "OMLX_PRELOAD_BLAS" in b["advice"]


def test_each_model_folder_names_its_cache_layout_and_whether_the_prefix_cache_holds_it(tmp_path):
    """Read from config.json without loading weights: a sliding-window gemma3 is on; a folder
    mlx-lm cannot build (an embedding model, say) is named so and warns of nothing; a model whose
    cache the prefix cache cannot hold is a warning."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tests.unit.engine.archs import tiny

    models = tmp_path / "home" / "models"
    (models / "broken").mkdir(parents=True)
    (models / "broken" / "config.json").write_text('{"model_type": "no_such_arch"}')
    g = models / "tiny-gemma3"
    g.mkdir()
    model = tiny("gemma3_text")
    mx.save_safetensors(str(g / "model.safetensors"), dict(tree_flatten(model.parameters())))
    from tests.unit.engine.archs import CONFIGS

    (g / "config.json").write_text(json.dumps(CONFIGS["gemma3_text"]))
    template = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "chatml_tools_thinking.jinja").read_text()
    (g / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    r, report = _doctor(tmp_path, "--port", str(_free_port()))
    found = next(f for f in report["findings"] if f["check"] == "models")
    caches = found["detail"]["caches"]
    assert caches["tiny-gemma3"] == {"layout": "W16k0,A,W16k0,A", "prefix_cache": True}
    assert caches["broken"]["prefix_cache"] is None and "not an mlx-lm language model" in caches["broken"]["layout"]
    assert found["level"] == "ok", found
    assert "tiny-gemma3 (cache W16k0,A,W16k0,A; prefix cache on; tool calls: hermes)" in found["summary"]
    assert found["detail"]["tool_dialects"] == {"broken": None, "tiny-gemma3": "hermes"}
    from omlx.cli.doctor import _model_caches

    cfg4 = load_config({"base_path": str(tmp_path / "home"), "hub_cache_dir": str(tmp_path / "hub")})
    assert _model_caches(cfg4, 4, 16)["tiny-gemma3"] == ("W16k0,Q4g16,W16k0,Q4g16", True)  # as --kv-bits 4 serves it
    facts = doctor.Facts(memory_ceiling_bytes=8 * 10**9, bind_problem=None,
                         model_caches={"tiny-gemma3": ("layer 0 uses ChunkedKVCache", False)})
    cfg = load_config({"base_path": str(tmp_path / "home")})
    f = doctor.check_models(cfg, facts)
    assert f.level == "warning" and f.fix and "prefix cache off: layer 0 uses ChunkedKVCache; tool calls: none detected" in f.summary


def test_the_tool_dialect_comes_from_the_template_else_the_vocabulary_and_the_config_overrides(tmp_path):
    from omlx.cli.doctor import _model_dialects
    from omlx.engine.catalogue import tool_dialect_of

    m = tmp_path / "home" / "models" / "m"
    m.mkdir(parents=True)
    (m / "config.json").write_text('{"model_type": "llama"}')
    assert tool_dialect_of(m) is None  # no tokenizer files
    (m / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}[TOOL_CALLS]{{ tools }}{% endfor %}")
    assert tool_dialect_of(m) == "mistral"
    (m / "chat_template.jinja").write_text("{{ tools }} {% for m in messages %}{{ m.content }}{% endfor %}")
    (m / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 1, "content": "<tool_call>"},
                                                                   {"id": 2, "content": "</tool_call>"}],
                                                  "model": {"vocab": {"a": 0}}}))
    assert tool_dialect_of(m) == "hermes"  # the template names no marker: the vocabulary does
    (m / "tokenizer.json").write_text("{not json")
    assert tool_dialect_of(m) is None
    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text('[models.m]\ntool_dialect = "qwen3_coder_xml"\n')
    cfg = load_config({"base_path": str(tmp_path / "home"), "hub_cache_dir": str(tmp_path / "hub")}, config_file=cfg_file)
    assert _model_dialects(cfg) == {"m": "qwen3_coder_xml"}
