"""Pulling from the Hugging Face hub through the admin API of a real server (`POST /v1/admin/pulls`
and its job routes, `GET /v1/admin/models`), against the local fake hub of tests/fake_hub.py
(``HF_ENDPOINT``), as the dashboard does it.

One server (with an API key) serves the whole module; each error is answered with its status in
the API's error shape, and after each one the server still serves. The hub repo is the real
SmolLM2-135M-Instruct quantized to 4 bits by ``mlx_lm.convert``; the other repos share its files
under other ids (gated, slow, failing) or are not mlx-lm models.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.fake_hub import FakeHub, Repo
from tests.helpers import MODEL_ID, ServerProcess, quantized_model_dir
from tests.integration.test_hub_models import REPO_ID, _odd_repos

KEY = "pull-api-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GATED, SLOW, BROKEN, BIG, FLAKY = ("someone/gated-smol", "someone/slow-smol", "someone/broken-smol",
                                   "someone/big-smol", "someone/flaky-upstream")


def _alias(repo: Repo, repo_id: str) -> Repo:
    """The same files under another id (no second copy of the bytes in memory)."""
    return Repo(repo_id, repo.files, repo.commit, dict(repo.refs))


@pytest.fixture(scope="module")
def hub():
    repo4 = Repo.from_folder(REPO_ID, quantized_model_dir(4), refs=("main", "v1"))
    repos = [repo4, *(_alias(repo4, r) for r in (GATED, SLOW, BROKEN, BIG, FLAKY)), *_odd_repos()]
    with FakeHub(repos) as h:
        h.gated.add(GATED)
        h.fail_api.add(FLAKY)
        h.repo4 = repo4
        yield h


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pull-api") / "hub"


@pytest.fixture(scope="module")
def server(hub, cache, tmp_path_factory):
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1"}
    with ServerProcess(["--api-key", KEY, "--no-ssd-cache"], base_path=tmp_path_factory.mktemp("pull-api-home"),
                       env=env) as s:
        s.http = httpx.Client(base_url=s.url, headers=AUTH, timeout=120)
        yield s
        s.http.close()


def post_pull(server, body) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return server.http.post("/v1/admin/pulls", content=body, headers={"content-type": "application/json"})
    return server.http.post("/v1/admin/pulls", json=body)


def wait_pull(server, pull_id: str, *states: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = server.http.get(f"/v1/admin/pulls/{pull_id}").json()
        if job["state"] in states:
            return job
        assert time.monotonic() < deadline, f"{pull_id} stayed {job['state']}: {job}"
        time.sleep(0.1)


def assert_error(r: httpx.Response, status: int, *, code: str | None = None, says: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    assert says in err["message"], err
    return err


def assert_serving(server) -> None:
    """The server answers and its catalogue still lists what it served before."""
    assert server.http.get("/health").status_code == 200
    r = server.http.get("/v1/models")
    assert r.status_code == 200 and MODEL_ID in [m["id"] for m in r.json()["data"]], r.text


def _repo_dirs(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("models--*")) if cache.is_dir() else []


def test_a_pull_runs_in_the_background_and_the_model_is_then_listed_and_served(server, hub, cache):
    r = post_pull(server, {"repo": REPO_ID})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["state"] in ("queued", "running", "done") and job["repo"] == REPO_ID and job["revision"] is None
    assert r.headers["location"] == f"/v1/admin/pulls/{job['id']}"
    size = sum(len(f.data) for p, f in hub.repo4.files.items() if p != "README.md")
    assert job["total_bytes"] == size  # known when the 202 comes: the checks ran first
    done = wait_pull(server, job["id"], "done", "failed")
    assert done["state"] == "done", done
    assert done["done_bytes"] == done["total_bytes"] == size and done["error"] is None
    assert done["rate_bytes_per_s"] > 0 and done["finished_at"] >= done["started_at"]
    assert done["model"]["id"] == REPO_ID and done["model"]["commit"] == hub.repo4.commit
    assert Path(done["model"]["path"]) == cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / hub.repo4.commit
    assert job["id"] in [p["id"] for p in server.http.get("/v1/admin/pulls").json()["pulls"]]

    assert REPO_ID in [m["id"] for m in server.http.get("/v1/models").json()["data"]]
    rows = {row["id"]: row for row in server.http.get("/v1/admin/models").json()["models"]}
    row = rows[REPO_ID]
    assert (row["source"], row["quantization"], row["bits"], row["group_size"], row["architecture"],
            row["context_length"], row["prefix_cache"], row["loaded"]) == (
        "hub cache", "4-bit, group 64", 4, 64, "llama", 8192, "on", False), row
    assert row["size_bytes"] == size
    assert rows[MODEL_ID]["loaded"] is True and rows[MODEL_ID]["source"] in ("GGUF import", "omlx home")

    # served from where it was pulled, and now loaded
    r = server.http.post("/v1/chat/completions", json={"model": REPO_ID, "max_tokens": 4, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "Say hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    rows = {row["id"]: row for row in server.http.get("/v1/admin/models").json()["models"]}
    assert rows[REPO_ID]["loaded"] is True

    # pulled again: nothing left to fetch, done at once
    again = post_pull(server, {"repo": REPO_ID, "revision": "v1"})
    assert again.status_code == 202 and again.json()["total_bytes"] == 0
    assert wait_pull(server, again.json()["id"], "done")["model"]["id"] == f"{REPO_ID}@v1"


@pytest.mark.parametrize("body, status, code, says", [
    ({"repo": "nobody/nothing"}, 404, "hub_repo_not_found", "no model nobody/nothing on http://127.0.0.1"),
    ({"repo": REPO_ID, "revision": "no-such-branch"}, 404, "hub_repo_not_found", "has no revision 'no-such-branch'"),
    ({"repo": GATED}, 403, "hub_access_denied", f"{GATED} is gated"),
    ({"repo": "someone/SmolLM2-GGUF"}, 422, "not_an_mlx_model", "it holds GGUF files"),
    ({"repo": "someone/smol-pytorch"}, 422, "not_an_mlx_model", "it has PyTorch weights only"),
    ({"repo": "someone/alien-arch"}, 422, "not_an_mlx_model", "'no_such_architecture' is not implemented by mlx-lm"),
    ({"repo": FLAKY}, 502, "hub_unreachable", "cannot reach http://127.0.0.1"),
], ids=["no-repo", "no-revision", "gated", "gguf", "pytorch", "alien-arch", "upstream-500"])
def test_a_refused_pull_answers_its_status_and_writes_nothing(server, hub, cache, body, status, code, says):
    before = _repo_dirs(cache)
    num_jobs = len(server.http.get("/v1/admin/pulls").json()["pulls"])
    assert_error(post_pull(server, body), status, code=code, says=says)
    assert _repo_dirs(cache) == before  # nothing written for the refused repo
    assert len(server.http.get("/v1/admin/pulls").json()["pulls"]) == num_jobs  # and no job made
    assert_serving(server)


def test_not_enough_disk_is_a_507_before_anything_is_written(server, hub, cache):
    hub.tree_sizes["model.safetensors"] = 10**15  # the hub says the weights are a petabyte
    try:
        assert_error(post_pull(server, {"repo": BIG}), 507, code="insufficient_disk",
                     says=f"not enough disk space for {BIG}: it needs 1,000,000,0")
    finally:
        hub.tree_sizes.clear()
    assert f"models--{BIG.replace('/', '--')}" not in _repo_dirs(cache)
    assert not [q for q in hub.requests if q[0] == "GET" and f"/{BIG}/resolve/" in q[1] and "safetensors" in q[1]]
    assert_serving(server)


@pytest.mark.parametrize("body, param, says", [
    (b"{not json", None, "not valid JSON"),
    (b"[]", None, "must be a JSON object"),
    ({}, "repo", "'repo' is required"),
    ({"repo": 7}, "repo", "'repo' must be a string"),
    ({"repo": "just-a-name"}, "repo", "'repo' must be a Hugging Face model id ORG/NAME"),
    ({"repo": "../etc/passwd"}, "repo", "must be a Hugging Face model id"),
    ({"repo": "0-/NW"}, "repo", "must be a Hugging Face model id"),  # no hub repo ends in '-' (schemathesis found it)
    ({"repo": REPO_ID, "revision": ""}, "revision", "'revision' must not be empty"),
    ({"repo": f"{REPO_ID}@main", "revision": "v1"}, "revision", "must be a Hugging Face model id"),
    ({"repo": REPO_ID, "branch": "main"}, "branch", "unknown field(s) 'branch'"),
], ids=["not-json", "array", "no-repo", "repo-not-string", "bare-name", "path", "hub-invalid", "empty-revision",
        "two-revisions",
        "unknown-key"])
def test_a_malformed_body_is_a_400(server, body, param, says):
    err = assert_error(post_pull(server, body), 400, says=says)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert_serving(server)


def test_a_second_pull_of_a_repo_is_a_409_and_cancel_stops_it_and_a_new_pull_resumes(server, hub, cache):
    hub.slow_file["model.safetensors"] = 0.1  # 84 pieces of 1 MiB: about 9 s
    try:
        r = post_pull(server, {"repo": SLOW})
        assert r.status_code == 202, r.text
        pull_id = r.json()["id"]
        running = wait_pull(server, pull_id, "running", timeout_s=30)
        assert_error(post_pull(server, {"repo": SLOW}), 409, code="conflict", says=f"{SLOW} is already being pulled")
        assert_error(post_pull(server, {"repo": SLOW, "revision": "v1"}), 409, code="conflict")
        assert_serving(server)
        deadline = time.monotonic() + 30
        while running["done_bytes"] < 3 * 2**20:  # some of the weights have arrived
            assert time.monotonic() < deadline, running
            time.sleep(0.1)
            running = server.http.get(f"/v1/admin/pulls/{pull_id}").json()
        assert running["state"] == "running" and 0 < running["done_bytes"] < running["total_bytes"], running
        assert running["rate_bytes_per_s"] and running["rate_bytes_per_s"] > 0, running
        r = server.http.post(f"/v1/admin/pulls/{pull_id}/cancel")
        assert r.status_code == 202 and r.json()["cancel_requested"] is True, r.text
        cancelled = wait_pull(server, pull_id, "cancelled", "done", "failed", timeout_s=30)
        assert cancelled["state"] == "cancelled" and cancelled["error"] is None, cancelled
        assert cancelled["done_bytes"] < cancelled["total_bytes"]
        assert server.http.post(f"/v1/admin/pulls/{pull_id}/cancel").status_code == 202  # again: no change
        assert SLOW not in [m["id"] for m in server.http.get("/v1/models").json()["data"]]  # not servable half done
        assert_serving(server)
    finally:
        hub.slow_file.clear()
    num_gets = len(hub.gets("model.safetensors"))
    r = post_pull(server, {"repo": SLOW})  # the cancelled pull freed the repo
    assert r.status_code == 202, r.text
    done = wait_pull(server, r.json()["id"], "done", "failed")
    assert done["state"] == "done", done
    assert SLOW in [m["id"] for m in server.http.get("/v1/models").json()["data"]]
    assert len(hub.gets("model.safetensors")) == num_gets + 1
    assert_error(server.http.post(f"/v1/admin/pulls/{r.json()['id']}/cancel"), 409, code="conflict",
                 says="has already finished")


def test_a_download_that_fails_upstream_fails_the_job_with_a_502(server, hub, cache):
    hub.fail_file.add("model.safetensors")
    try:
        r = post_pull(server, {"repo": BROKEN})
        assert r.status_code == 202, r.text  # the checks pass; the weights then fail
        job = wait_pull(server, r.json()["id"], "failed", "done")
    finally:
        hub.fail_file.clear()
    assert job["state"] == "failed" and job["model"] is None, job
    assert job["error"]["status"] == 502 and job["error"]["code"] == "hub_unreachable", job
    assert "run the same command again to resume" in job["error"]["message"]
    assert BROKEN not in [m["id"] for m in server.http.get("/v1/models").json()["data"]]
    assert_serving(server)


def test_unknown_pull_ids_are_404(server):
    assert_error(server.http.get("/v1/admin/pulls/pull-999"), 404, says="no pull 'pull-999'")
    assert_error(server.http.post("/v1/admin/pulls/pull-999/cancel"), 404, says="no pull 'pull-999'")
    assert_serving(server)


@pytest.mark.parametrize("method, path", [("GET", "/v1/admin/models"), ("GET", "/v1/admin/pulls"),
                                          ("POST", "/v1/admin/pulls"), ("GET", "/v1/admin/pulls/pull-1"),
                                          ("POST", "/v1/admin/pulls/pull-1/cancel")])
def test_the_routes_need_the_api_key(server, method, path):
    r = httpx.request(method, server.url + path, json={"repo": REPO_ID}, timeout=30)
    assert_error(r, 401, code="invalid_api_key")
    r = httpx.request(method, server.url + path, json={"repo": REPO_ID}, headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401


def test_the_server_still_serves_generation_after_everything(server):
    r = server.http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "Rivers and", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
