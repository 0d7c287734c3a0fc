"""Models from the Hugging Face Hub: `omlx models pull` against a local fake hub (tests/fake_hub.py,
reached through ``HF_ENDPOINT``), `--model ORG/NAME` served straight from the hub cache, and a
4-bit mlx-lm conversion served with the prefix cache on, exactly as without it.

The hub repo is the real SmolLM2-135M-Instruct quantized to 4 bits by ``mlx_lm.convert`` (what
mlx-community publishes). Each `omlx models pull` is a real CLI process, as a user runs it
(``huggingface_hub`` reads ``HF_*`` when imported).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from omlx.cli.main import app
from tests.fake_hub import FakeHub, Repo
from tests.helpers import REPO, TEST_HOME, ServerProcess, free_port, quantized_model_dir, running

REPO_ID = "mlx-community/SmolLM2-135M-Instruct-4bit"
#: What mlx-lm's allow patterns leave out of the repo (a model card is not part of the model).
NOT_PULLED = {"README.md"}
runner = CliRunner()


@pytest.fixture(scope="module")
def repo4() -> Repo:
    return Repo.from_folder(REPO_ID, quantized_model_dir(4), refs=("main", "v1"))


def _odd_repos() -> list[Repo]:
    """Repos that are not mlx-lm models: a GGUF repo, PyTorch weights, an architecture mlx-lm lacks."""
    gguf = Repo.from_folder("someone/SmolLM2-GGUF", Path("/nonexistent"),
                            extra={"README.md": b"# gguf", "smollm2.Q4_K_M.gguf": b"GGUF" + b"\0" * 1000})
    torch = Repo.from_folder("someone/smol-pytorch", Path("/nonexistent"),
                             extra={"config.json": b'{"model_type": "llama"}', "pytorch_model.bin": b"\0" * 1000,
                                    "tokenizer.json": b"{}"})
    alien = Repo.from_folder("someone/alien-arch", Path("/nonexistent"),
                             extra={"config.json": b'{"model_type": "no_such_architecture"}',
                                    "model.safetensors": b"\0" * 64, "tokenizer.json": b"{}"})
    return [gguf, torch, alien]


@pytest.fixture()
def hub(repo4):
    with FakeHub([repo4, *_odd_repos()]) as h:
        yield h


def _env(hub_url: str, cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONPATH": str(REPO), "COLUMNS": "200", **extra}


def _pull(spec: str, env: dict[str, str], prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(prefix or []), sys.executable, "-m", "omlx", "models", "pull", spec], env=env,
                          capture_output=True, text=True, timeout=300)


def _out(r: subprocess.CompletedProcess) -> str:
    return " ".join((r.stdout + r.stderr).split())


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _repo_dirs(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("models--*")) if cache.is_dir() else []


def test_pull_fetches_the_mlx_files_and_reports_size_and_quantization(hub, repo4, tmp_path):
    cache = tmp_path / "hub"
    r = _pull(REPO_ID, _env(hub.url, cache, HF_TOKEN="hf_test_token"))
    assert r.returncode == 0, _out(r)
    assert {auth for *_, auth in hub.requests} == {"Bearer hf_test_token"}  # HF_TOKEN goes with every call
    out = _out(r)
    snap = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / repo4.commit
    assert f"pulled {REPO_ID} (commit {repo4.commit[:12]}, fetched" in out, out
    assert "4-bit, group 64, llama, context 8192" in out and f"omlx serve --model {REPO_ID}" in out, out
    size_mb = sum(len(f.data) for p, f in repo4.files.items() if p not in NOT_PULLED) / 1e6
    assert f"{size_mb:,.1f} MB on disk" in out, out
    assert sorted(p.name for p in snap.iterdir()) == sorted(set(repo4.files) - NOT_PULLED)
    for name in set(repo4.files) - NOT_PULLED:  # byte for byte what the hub holds
        assert _sha(snap / name) == repo4.files[name].sha256, name
    assert (cache / f"models--{REPO_ID.replace('/', '--')}" / "refs" / "main").read_text() == repo4.commit
    # pulled again: nothing is fetched (only the repo info and file list are asked for)
    num_gets = len(hub.gets("model.safetensors"))
    r = _pull(REPO_ID, _env(hub.url, cache))
    assert r.returncode == 0 and "already in the cache" in _out(r), _out(r)
    assert len(hub.gets("model.safetensors")) == num_gets


def test_pull_resumes_a_file_after_the_server_drops_the_connection(hub, repo4, tmp_path):
    cache = tmp_path / "hub"
    hub.drop_after["model.safetensors"] = 30_000_000  # of 84 MB
    r = _pull(REPO_ID, _env(hub.url, cache))
    assert r.returncode == 0, _out(r)
    gets = hub.gets("model.safetensors")
    assert gets[0] is None and len(gets) == 2 and gets[1].startswith("bytes="), gets  # a Range request went on
    resumed_at = int(gets[1][len("bytes="):-1])
    assert 0 < resumed_at <= 30_000_000
    size = len(repo4.files["model.safetensors"].data)
    assert hub.bytes_sent["model.safetensors"] == 30_000_000 + size - resumed_at  # the rest, not the whole file again
    snap = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / repo4.commit
    assert _sha(snap / "model.safetensors") == repo4.files["model.safetensors"].sha256


def test_a_failed_pull_keeps_finished_files_and_the_next_one_fetches_only_the_rest(hub, repo4, tmp_path):
    cache = tmp_path / "hub"
    hub.fail_file.add("model.safetensors")
    r = _pull(REPO_ID, _env(hub.url, cache))
    assert r.returncode == 1 and "run the same command again to resume" in _out(r), _out(r)
    assert "Traceback" not in r.stderr
    blobs = cache / f"models--{REPO_ID.replace('/', '--')}" / "blobs"
    done = {p: f for p, f in repo4.files.items() if (blobs / f.etag).is_file()}
    assert not list(blobs.glob("*.incomplete"))  # no half-written file is left
    hub.fail_file.clear()
    before = {p: len(hub.gets(p)) for p in repo4.files}
    r = _pull(REPO_ID, _env(hub.url, cache))
    assert r.returncode == 0, _out(r)
    for p in done:
        assert len(hub.gets(p)) == before[p], f"{p} was fetched again"
    assert len(hub.gets("model.safetensors")) == before["model.safetensors"] + 1


def test_a_revision_that_does_not_exist_is_a_clear_error_and_writes_nothing(hub, repo4, tmp_path):
    cache = tmp_path / "hub"
    r = _pull(f"{REPO_ID}@no-such-branch", _env(hub.url, cache))
    assert r.returncode == 1
    assert f"cannot pull {REPO_ID}@no-such-branch: {REPO_ID} has no revision 'no-such-branch'" in _out(r), _out(r)
    assert _repo_dirs(cache) == []
    r = _pull("nobody/nothing", _env(hub.url, cache))
    assert r.returncode == 1 and "no model nobody/nothing on http://127.0.0.1" in _out(r), _out(r)
    # a tag pins a revision: ORG/NAME@v1 is served under that id
    r = _pull(f"{REPO_ID}@v1", _env(hub.url, cache))
    assert r.returncode == 0 and f"pulled {REPO_ID}@v1 (commit {repo4.commit[:12]}" in _out(r), _out(r)
    r = _pull(f"{REPO_ID}@{repo4.commit}", _env(hub.url, cache))  # a commit hash: nothing new to fetch
    assert r.returncode == 0 and "already in the cache" in _out(r) and f"--model {REPO_ID}@{repo4.commit}" in _out(r)
    r = runner.invoke(app, ["models", "list", "--json", "--base-path", str(tmp_path / "home"), "--hub-cache-dir", str(cache)])
    assert [row["id"] for row in json.loads(r.stdout)] == [f"{REPO_ID}@v1"]  # the ref v1 names this snapshot


@pytest.mark.parametrize("repo_id, why", [
    ("someone/SmolLM2-GGUF", "it holds GGUF files (smollm2.Q4_K_M.gguf); download one and run `omlx models import FILE.gguf`"),
    ("someone/smol-pytorch", "it has PyTorch weights only; convert it with `mlx_lm.convert --hf-path someone/smol-pytorch -q`"),
    ("someone/alien-arch", "model_type 'no_such_architecture' is not implemented by mlx-lm"),
])
def test_a_repo_that_is_not_an_mlx_model_is_refused_and_leaves_nothing(hub, tmp_path, repo_id, why):
    cache = tmp_path / "hub"
    r = _pull(repo_id, _env(hub.url, cache))
    assert r.returncode == 1 and why in _out(r), _out(r)
    assert "Traceback" not in r.stderr
    assert _repo_dirs(cache) == []
    assert not [q for q in hub.requests if "/resolve/" in q[1] and q[1].endswith(("gguf", ".bin", "safetensors"))]


def _mount_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for 'unshare -m' and a tmpfs mount"
    if shutil.which("unshare") is None:
        return "'unshare' (util-linux) is not installed"
    r = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", "/mnt"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"cannot mount a tmpfs in a private namespace: {r.stderr.strip()}"


@pytest.mark.skipif(_mount_unavailable() is not None, reason=str(_mount_unavailable()))
def test_a_disk_too_small_is_refused_before_anything_is_written(hub, tmp_path):
    """The hub cache is a 20 MB tmpfs (in a private mount namespace); the model needs 88 MB."""
    cache = tmp_path / "hub"
    cache.mkdir()
    mount = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=20m tmpfs "$0" && "$@"; rc=$?; '
             'cd "$0" && find . -mindepth 1 > "$0.after"; exit $rc', str(cache)]
    r = subprocess.run([*mount, sys.executable, "-m", "omlx", "models", "pull", REPO_ID],
                       env=_env(hub.url, cache), capture_output=True, text=True, timeout=300)
    out = _out(r)
    assert r.returncode == 1 and f"not enough disk space for {REPO_ID}: it needs 87.8 MB" in out, out
    assert "(nothing was written)" in out and "Traceback" not in out
    assert not [q for q in hub.requests if "/resolve/" in q[1] and q[0] == "GET" and "safetensors" in q[1]]
    assert Path(f"{cache}.after").read_text().split() == []  # the tmpfs, seen before its namespace went


@pytest.mark.skipif(_mount_unavailable() is not None, reason=str(_mount_unavailable()))
def test_a_disk_that_fills_up_during_the_pull_leaves_nothing_half_written(hub, repo4, tmp_path):
    """The tree listing understates the weights (1 MB), so the check passes on a 40 MB tmpfs; the
    84 MB file then fills it: the pull says so and removes what it wrote."""
    cache = tmp_path / "hub"
    cache.mkdir()
    hub.tree_sizes["model.safetensors"] = 2**20
    mount = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=40m tmpfs "$0" && "$@"; rc=$?; '
             'cd "$0" && find . -mindepth 1 > "$0.after"; exit $rc', str(cache)]
    r = subprocess.run([*mount, sys.executable, "-m", "omlx", "models", "pull", REPO_ID],
                       env=_env(hub.url, cache), capture_output=True, text=True, timeout=300)
    out = _out(r)
    assert r.returncode == 1 and f"the disk under {cache} filled up while fetching {REPO_ID}" in out, out
    assert "(the partial download was removed)" in out and "Traceback" not in out
    # seen inside the namespace, before the tmpfs went: only huggingface_hub's cache-wide files remain
    assert sorted(Path(f"{cache}.after").read_text().split()) == ["./.locks", "./CACHEDIR.TAG"]


@pytest.fixture(scope="module")
def pulled_cache(repo4, tmp_path_factory) -> Path:
    """A hub cache holding the 4-bit repo, pulled once through the fake hub."""
    cache = tmp_path_factory.mktemp("pulled") / "hub"
    with FakeHub([repo4]) as h:
        r = _pull(REPO_ID, _env(h.url, cache))
    assert r.returncode == 0, _out(r)
    return cache


def test_offline_mode_answers_from_the_cache(pulled_cache, tmp_path):
    dead = "http://127.0.0.1:9"  # nothing listens there: any network call would fail
    r = _pull(REPO_ID, _env(dead, pulled_cache, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0 and "already in the cache" in _out(r), _out(r)
    r = _pull("someone/not-cached", _env(dead, pulled_cache, HF_HUB_OFFLINE="1"))
    assert r.returncode == 1 and "HF_HUB_OFFLINE is set and someone/not-cached is not in the hub cache" in _out(r)
    # online but the hub is unreachable: a cached model is still fine, another one is a clear error
    r = _pull(REPO_ID, _env(dead, pulled_cache))
    assert r.returncode == 0 and "already in the cache" in _out(r), _out(r)
    r = _pull("someone/not-cached", _env(dead, pulled_cache))
    assert r.returncode == 1 and "cannot reach http://127.0.0.1:9 to fetch someone/not-cached" in _out(r), _out(r)
    assert "Traceback" not in r.stderr


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir(parents=True)
    return home


def test_models_list_shows_source_size_quantization_arch_context_and_prefix_cache(pulled_cache, tmp_path):
    home = _home(tmp_path)
    r = runner.invoke(app, ["models", "import", str(quantized_model_dir(4)), "--name", "smol-copy",
                            "--base-path", str(home)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["models", "list", "--json", "--base-path", str(home), "--hub-cache-dir", str(pulled_cache)])
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row for row in json.loads(r.stdout)}
    hub_row = rows[REPO_ID]
    assert hub_row["source"] == "hub cache" and hub_row["bits"] == 4 and hub_row["group_size"] == 64
    assert hub_row["quantization"] == "4-bit, group 64" and hub_row["architecture"] == "llama"
    assert hub_row["context_length"] == 8192 and hub_row["prefix_cache"] == "on"
    assert 80e6 < hub_row["size_bytes"] < 95e6
    assert rows["smol-copy"]["source"] == "omlx home" and rows["smol-copy"]["bits"] == 4
    # the table a person reads
    r = runner.invoke(app, ["models", "list", "--base-path", str(home), "--hub-cache-dir", str(pulled_cache)])
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(REPO_ID))
    assert line.split()[:7] == [REPO_ID, "hub", "cache", f"{hub_row['size_bytes'] / 1e6:,.0f}", "MB", "4-bit,", "group"]
    # a GGUF import is named so (the shared test home's default model came from its GGUF)
    other = _home(tmp_path / "g")
    (other / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    r = runner.invoke(app, ["models", "list", "--json", "--base-path", str(other), "--hub-cache-dir", str(tmp_path / "none")])
    rows = {row["id"]: row for row in json.loads(r.stdout)}
    assert rows["SmolLM2-135M-Instruct"]["source"] == "GGUF import"
    assert rows["SmolLM2-135M-Instruct"]["quantization"] == "float32"


def test_serve_model_org_name_not_in_the_cache_says_how_to_pull_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "omlx", "serve", "--port", str(free_port()), "--base-path", str(tmp_path / "home"),
                        "--model", "someone/not-pulled"], capture_output=True, text=True, timeout=180,
                       env=_env("http://127.0.0.1:9", tmp_path / "hub"))
    out = _out(r)
    assert r.returncode == 1, out
    assert (f"The model 'someone/not-pulled' does not exist: it is not in the Hugging Face hub cache ({tmp_path / 'hub'}); "
            "fetch it with `omlx models pull someone/not-pulled`") in out, out
    assert "Traceback" not in out


def test_the_pool_catalogue_lists_hub_models_and_resolves_them_in_place(pulled_cache, repo4, tmp_path):
    """`/v1/models` is `EnginePool.listed_ids`: a hub-cache model is listed, and a request naming it
    resolves to its snapshot folder without anything being copied."""
    from omlx.config import load_config
    from omlx.errors import ModelNotFoundError
    from omlx.pool import EnginePool

    cfg = load_config({"base_path": str(_home(tmp_path)), "hub_cache_dir": str(pulled_cache)}, env={})
    pool = EnginePool(cfg, loader=lambda *a: pytest.fail("nothing is loaded here"))
    try:
        assert REPO_ID in pool.listed_ids()
        assert pool.resolve_id(REPO_ID) == REPO_ID
        assert pool.resolve_id(f"{REPO_ID}@main") == REPO_ID  # the default branch is the plain id
        with pytest.raises(ModelNotFoundError):
            pool.resolve_id(f"{REPO_ID}@v1")  # a tag that was never pulled
        path, task = pool.catalogue.resolve_path(REPO_ID, pool.catalogue.records[REPO_ID].source)
        assert task == "chat" and path == pulled_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / repo4.commit
        with pytest.raises(Exception, match="omlx models pull someone/other"):
            from omlx.engine.loader import resolve_model

            resolve_model("someone/other", cfg.models_dir, hub_cache=pulled_cache)
    finally:
        pool.stop()


def test_models_rm_removes_what_omlx_owns_and_the_hub_cache_only_when_asked(pulled_cache, tmp_path):
    cache = tmp_path / "hub"
    shutil.copytree(pulled_cache, cache, symlinks=True)
    home = _home(tmp_path)
    args = ["--base-path", str(home), "--hub-cache-dir", str(cache)]
    r = runner.invoke(app, ["models", "rm", REPO_ID, *args])
    assert r.exit_code == 1 and "is in the shared Hugging Face hub cache" in r.output and "--hub-cache" in r.output
    assert _repo_dirs(cache) == [f"models--{REPO_ID.replace('/', '--')}"]
    r = runner.invoke(app, ["models", "rm", REPO_ID, "--hub-cache", *args])
    assert r.exit_code == 0 and f"removed {REPO_ID} from the hub cache" in r.output, r.output
    assert _repo_dirs(cache) == []
    r = runner.invoke(app, ["models", "rm", "nothing-here", *args])
    assert r.exit_code == 1 and "no model 'nothing-here'" in r.output


def test_models_import_quantize_uses_mlx_lm_convert(tmp_path):
    home = _home(tmp_path)
    from tests.helpers import default_model_dir

    r = runner.invoke(app, ["models", "import", str(default_model_dir()), "--name", "smol-8bit", "--quantize", "8",
                            "--base-path", str(home)])
    assert r.exit_code == 0 and "quantized to 8 bits (group size 64)" in r.output, r.output
    config = json.loads((home / "models" / "smol-8bit" / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 64
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".")]  # no temp folder left
    r = runner.invoke(app, ["models", "list", "--json", "--base-path", str(home), "--hub-cache-dir", str(tmp_path / "none")])
    (row,) = json.loads(r.stdout)
    assert row["id"] == "smol-8bit" and row["quantization"] == "8-bit, group 64" and row["prefix_cache"] == "on"
    r = runner.invoke(app, ["models", "rm", "smol-8bit", "--base-path", str(home)])
    assert r.exit_code == 0 and not (home / "models" / "smol-8bit").exists()
    # a GGUF is dequantized by omlx's importer, then quantized by mlx-lm
    from omlx.engine.embedded import default_model_gguf

    gguf = default_model_gguf(TEST_HOME / "models" / ".cache")
    r = runner.invoke(app, ["models", "import", str(gguf), "--name", "smol-q4", "--quantize", "4", "--base-path", str(home)])
    assert r.exit_code == 0 and "quantized to 4 bits" in r.output, r.output
    r = runner.invoke(app, ["models", "list", "--json", "--base-path", str(home), "--hub-cache-dir", str(tmp_path / "none")])
    (row,) = json.loads(r.stdout)
    assert (row["id"], row["source"], row["quantization"]) == ("smol-q4", "GGUF import", "4-bit, group 64")
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".")]


def test_serve_model_org_name_from_the_hub_cache_with_the_prefix_cache_exact(pulled_cache, tmp_path):
    """`omlx serve --model ORG/NAME` (offline: nothing is fetched) serves the 4-bit snapshot in place;
    with the prefix cache on, a repeated prompt hits the cache and the text is the text without it."""
    import openai

    env = {"HF_HUB_CACHE": str(pulled_cache), "HF_HUB_OFFLINE": "1"}
    prompt = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 40) + ". Name three of them."
    on = ServerProcess(["--model", REPO_ID, "--block-size", "32", "--no-ssd-cache"], base_path=tmp_path / "on", env=env)
    off = ServerProcess(["--model", REPO_ID, "--no-cache"], base_path=tmp_path / "off", env=env)
    with running(on, off):
        c_on = openai.OpenAI(base_url=on.url + "/v1", api_key="x", max_retries=0)
        c_off = openai.OpenAI(base_url=off.url + "/v1", api_key="x", max_retries=0)
        assert REPO_ID in [m.id for m in c_on.models.list().data]
        outs = []
        for client in (c_on, c_on, c_off):
            r = client.chat.completions.create(model=REPO_ID, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=24, temperature=0)
            outs.append(r)
        assert outs[0].choices[0].message.content  # it says something
        assert outs[1].usage.prompt_tokens_details.cached_tokens >= 32 * 4, outs[1].usage
        assert outs[0].choices[0].message.content == outs[1].choices[0].message.content == outs[2].choices[0].message.content
    # served in place: nothing was copied into omlx's models folder
    assert not [p for p in (TEST_HOME / "models").iterdir() if "4bit" in p.name]
