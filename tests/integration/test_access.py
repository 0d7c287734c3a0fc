"""Access control and limits on a real server with an API key.

Keys as ``Authorization: Bearer`` or ``x-api-key`` (constant-time compare); every route but
``/`` and ``/health`` needs one, admin routes included; the folders omlx creates are 0700;
model ids in bodies and paths never leave the models folder; body and header limits answer
413/431 in the route's error shape. Start-up refusals (non-loopback bind without a key, a
busy port) are in test_startup_refusals below (they exit before any model is loaded).
"""

from __future__ import annotations

import inspect
import os
import socket
import stat
import subprocess
import sys

import httpx
import pytest

from tests.helpers import MODEL_ID, ServerProcess, free_port

KEY = "sk-omlx-access-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
MAX_BODY = 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("access-home")
    env = {"OMLX_MAX_BODY_BYTES": str(MAX_BODY), "OMLX_API_KEY": KEY}
    with ServerProcess(base_path=home / "omlx", env=env) as s:
        yield s


# ---- keys -------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers,ok", [
    ({"Authorization": f"Bearer {KEY}"}, True),
    ({"authorization": f"bearer {KEY}"}, True),
    ({"x-api-key": KEY}, True),
    ({}, False),
    ({"Authorization": "Bearer"}, False),
    ({"Authorization": f"Bearer {KEY}x"}, False),
    ({"Authorization": f"Bearer {KEY[:-1]}"}, False),
    ({"Authorization": KEY}, False),
    ({"Authorization": f"Basic {KEY}"}, False),
    ({"x-api-key": "wrong"}, False),
], ids=["bearer", "bearer-lowercase", "x-api-key", "none", "empty", "longer", "shorter", "no-scheme", "basic", "wrong"])
def test_key_forms(server, headers, ok):
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"


def test_anthropic_route_answers_401_in_its_shape(server):
    r = httpx.post(server.url + "/v1/messages", json=CHAT, timeout=30)
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"


def test_keys_are_compared_in_constant_time():
    from omlx.api.app import check_api_key

    assert "hmac.compare_digest" in inspect.getsource(check_api_key)


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models/status"), ("POST", f"/v1/models/{MODEL_ID}/load"), ("POST", f"/v1/models/{MODEL_ID}/unload"),
    ("GET", "/v1/cache/stats"), ("GET", "/v1/models"), ("GET", "/openapi.json"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
    ("POST", "/v1/messages/count_tokens"), ("HEAD", "/v1/models"), ("GET", "/v1/admin/models"),
    ("POST", "/v1/admin/pulls"), ("GET", "/v1/admin/pulls"), ("POST", "/v1/admin/pulls/pull-1/cancel"),
])
def test_admin_and_api_routes_need_the_key(server, method, path):
    r = httpx.request(method, server.url + path, timeout=30)
    assert r.status_code == 401, (method, path, r.status_code)
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["models"][0]["alive"]  # unload without a key did nothing


def test_health_and_root_are_open(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/", timeout=10).status_code == 200


# ---- folders ----------------------------------------------------------------------------------

def test_folders_are_created_0700(server):
    for d in (server.base_path, server.base_path / "cache"):
        assert d.is_dir(), d
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, (d, oct(os.stat(d).st_mode))


def test_make_private_dir_tightens_an_existing_folder(tmp_path):
    from omlx.api.server import make_private_dir

    (tmp_path / "open").mkdir(mode=0o755)
    make_private_dir(tmp_path / "open")
    make_private_dir(tmp_path / "new" / "nested")
    assert stat.S_IMODE(os.stat(tmp_path / "open").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "nested").st_mode) == 0o700


# ---- traversal --------------------------------------------------------------------------------

ESCAPES = ["..", "../..", "../models", f"../models/{MODEL_ID}", f"./{MODEL_ID}", "/etc", "/etc/passwd",
           f"models/../{MODEL_ID}", "..\\..\\etc", "%2e%2e", "..%2f..%2fetc", "%2Fetc%2Fpasswd", "~", "~root",
           f"{MODEL_ID}/..", f"{MODEL_ID}/../{MODEL_ID}", "outside-link/x", "a" * 300, ".hidden", "con\x00sole"]


@pytest.fixture(scope="module")
def outside_link(server, tmp_path_factory):
    """A symlink in the models folder to a directory outside it that holds another 'model'."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "x").mkdir()
    (outside / "x" / "config.json").write_text("{}")
    models = server.base_path / "models"  # (a symlink to the shared test models folder)
    link = models / "outside-link"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    yield link
    link.unlink()


@pytest.mark.parametrize("name", ESCAPES)
def test_model_ids_in_bodies_never_leave_the_models_folder(server, outside_link, name):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "model": name}, headers=AUTH, timeout=30)
    assert r.status_code in (400, 404), (name, r.status_code, r.text)
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("name", ESCAPES)
def test_model_ids_in_paths_never_leave_the_models_folder(server, outside_link, name):
    from urllib.parse import quote

    for path in (f"/v1/models/{quote(name, safe='')}", f"/v1/models/{quote(name, safe='')}/load"):
        method = "POST" if path.endswith("/load") else "GET"
        r = httpx.request(method, server.url + path, headers=AUTH, timeout=30)
        assert r.status_code in (400, 404, 405), (path, r.status_code, r.text)
    status = httpx.get(server.url + "/v1/models/status", headers=AUTH, timeout=10).json()
    assert all(".." not in str(m) and "/etc" not in str(m) for m in status.get("models", [])), status


def test_raw_dot_segments_in_the_url_do_not_escape(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(f"GET /v1/models/../../../etc/passwd HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head = data.split(b"\r\n", 1)[0]
    assert b" 404 " in head or b" 400 " in head, head
    assert b"root:" not in data


# ---- limits -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path,anthropic", [("/v1/chat/completions", False), ("/v1/messages", True)])
def test_body_over_the_limit_is_413_in_the_routes_shape(server, path, anthropic):
    big = b'{"model": "x", "pad": "' + b"a" * (MAX_BODY + 10) + b'"}'
    r = httpx.post(server.url + path, content=big, headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    body = r.json()
    assert (body["error"]["type"] == "request_too_large") if anthropic else (body["error"]["type"] == "invalid_request_error")
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60).status_code == 200


def test_headers_over_the_limit_are_431_in_our_shape(server):
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "x-pad": "a" * (20 * 1024)}, timeout=30)
    assert r.status_code == 431, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- start-up refusals --------------------------------------------------------------------------

def _serve(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "OMLX_API_KEY"}
    return subprocess.run([sys.executable, "-m", "omlx", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={**e, **(env or {})})


def test_default_bind_is_loopback():
    from omlx.config import ServerConfig, load_config

    assert ServerConfig().host == "127.0.0.1"
    assert load_config(env={}).host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_non_loopback_bind_without_key_is_refused(tmp_path, host):
    r = _serve("--host", host, "--port", str(free_port()), "--base-path", str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"refusing to bind {host} without an API key" in " ".join((r.stdout + r.stderr).split())


def test_busy_port_is_refused_with_a_clear_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = _serve("--port", str(port), "--base-path", str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"port {port} on 127.0.0.1 is already in use; pick another with --port" in " ".join((r.stdout + r.stderr).split())
