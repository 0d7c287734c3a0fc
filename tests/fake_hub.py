"""A local stand-in for the Hugging Face Hub, on 127.0.0.1, for `huggingface_hub` pointed at it
with ``HF_ENDPOINT``.

It answers the routes ``snapshot_download`` and ``hf_hub_download`` call (huggingface_hub 2.x:
``hf_api.model_info``, ``hf_api._iter_repo_tree_pages``, ``file_download.get_hf_file_metadata``,
``file_download.http_get``):

  GET  /api/models/{org}/{name}[/revision/{rev}]    repo info: ``sha`` = the revision's commit
  GET  /api/models/{org}/{name}/tree/{rev}?recursive=...   one page of file entries (size, oid, lfs)
  HEAD /{org}/{name}/resolve/{rev}/{path}           ``X-Repo-Commit``, ``ETag`` (LFS sha256 or git blob
                                                    sha1), ``X-Linked-Size``, ``Content-Length``
  GET  /{org}/{name}/resolve/{rev}/{path}           the bytes; ``Range: bytes=N-`` gives a 206

Errors carry the hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``)
so huggingface_hub raises its own typed errors. Faults: `drop_after` cuts a file's body after N
bytes (the connection closes mid-file, as a flaky network does); `fail_file` answers 500 for a file;
`tree_sizes` makes the tree listing misstate a file's size (understated, a disk check made from it
passes; overstated, it fails); `fail_api` answers 500 to a repo's API routes (an upstream failure);
`gated` answers a repo's file routes 403 with ``X-Error-Code: GatedRepo`` (the real hub's answer
to a token whose account has not accepted the repo's terms; its API routes still answer);
`slow_file` sends a file in 1 MiB pieces with that many seconds between them (a pull to watch).
Every request is recorded in `requests` (method, path, Range header, Authorization header).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: Files above this size, and every *.safetensors, are LFS files (as on the real hub).
LFS_MIN_BYTES = 10 * 2**20


@dataclass
class RepoFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class Repo:
    """One model repo: its files at one commit, and the refs (branches, tags) naming that commit."""

    repo_id: str
    files: dict[str, RepoFile]
    commit: str
    refs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_folder(cls, repo_id: str, folder: Path, *, extra: dict[str, bytes] | None = None,
                    refs: tuple[str, ...] = ("main",)) -> "Repo":
        files: dict[str, RepoFile] = {}
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                rel = p.relative_to(folder).as_posix()
                files[rel] = RepoFile(rel, p.read_bytes(), False)
        for rel, data in (extra or {}).items():
            files[rel] = RepoFile(rel, data, False)
        for f in files.values():
            f.lfs = f.path.endswith((".safetensors", ".gguf", ".bin")) or len(f.data) >= LFS_MIN_BYTES
        digest = hashlib.sha1(repo_id.encode())
        for rel in sorted(files):
            digest.update(rel.encode() + b"\0" + files[rel].etag.encode())
        commit = digest.hexdigest()
        return cls(repo_id, files, commit, {r: commit for r in refs})

    def resolve(self, rev: str) -> str | None:
        return self.commit if rev == self.commit else self.refs.get(rev)


class FakeHub:
    """The fake hub server; use as a context manager (``with FakeHub([repo]) as hub: hub.url``)."""

    def __init__(self, repos: list[Repo]):
        self.repos = {r.repo_id: r for r in repos}
        self.requests: list[tuple[str, str, str | None, str | None]] = []
        self.drop_after: dict[str, int] = {}  # file path -> bytes sent before the connection is cut
        self.num_drops: dict[str, int] = {}  # file path -> cuts left (default 1 per drop_after entry)
        self.fail_file: set[str] = set()
        self.tree_sizes: dict[str, int] = {}  # file path -> size the tree listing claims (a lying hub)
        self.fail_api: set[str] = set()  # repo ids whose API routes answer 500
        self.gated: set[str] = set()  # repo ids whose files answer 403 GatedRepo
        self.slow_file: dict[str, float] = {}  # file path -> seconds between 1 MiB pieces
        self.bytes_sent: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gets(self, path: str) -> list[str | None]:
        """The Range headers of each GET of a file (None: the whole file)."""
        return [rng for m, p, rng, _ in self.requests if m == "GET" and p.endswith("/" + path) and "/resolve/" in p]

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
                body = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                if commit:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self) -> None:
                self._route()

            def do_GET(self) -> None:
                self._route()

            def _route(self) -> None:
                url = urlsplit(self.path)
                with hub._lock:
                    hub.requests.append((self.command, unquote(url.path), self.headers.get("Range"),
                                         self.headers.get("Authorization")))
                parts = url.path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) == 4:  # model_info without a revision
                    return self._api(f"{parts[2]}/{parts[3]}", "revision", "main")
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    return self._api(f"{parts[2]}/{parts[3]}", parts[4], unquote("/".join(parts[5:])))
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._file(f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote("/".join(parts[4:])))
                self._error(404, "EntryNotFound", f"no route {url.path}")

            def _api(self, repo_id: str, kind: str, rev: str) -> None:
                if repo_id in hub.fail_api:
                    return self._error(500, "Internal", "injected upstream failure")
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found")
                commit = repo.resolve(rev)
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                if kind == "revision":
                    return self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                       "siblings": [{"rfilename": p} for p in sorted(repo.files)]})
                entries = []
                for f in sorted(repo.files.values(), key=lambda f: f.path):
                    size = hub.tree_sizes.get(f.path, len(f.data))
                    e = {"type": "file", "path": f.path, "size": size, "oid": f.git_oid}
                    if f.lfs:
                        e["lfs"] = {"oid": f.sha256, "size": size, "pointerSize": 134}
                    entries.append(e)
                self._json(entries)

            def _file(self, repo_id: str, rev: str, path: str) -> None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found")
                commit = repo.resolve(rev)
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                if repo_id in hub.gated:
                    return self._error(403, "GatedRepo", "Access to model is restricted: you must accept its terms",
                                       commit)
                f = repo.files.get(path)
                if f is None:
                    return self._error(404, "EntryNotFound", f"{path} does not exist", commit)
                if path in hub.fail_file and self.command == "GET":
                    return self._error(500, "Internal", "injected failure")
                size = len(f.data)
                start = 0
                rng = self.headers.get("Range")
                if rng and self.command == "GET" and rng.startswith("bytes=") and rng.endswith("-"):
                    start = int(rng[len("bytes="):-1])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{f.etag}"')
                if f.lfs:
                    self.send_header("X-Linked-Etag", f'"{f.etag}"')
                    self.send_header("X-Linked-Size", str(size))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Type", "application/octet-stream")
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.send_header("Content-Length", str(size - start))
                self.end_headers()
                if self.command == "HEAD":
                    return
                body = f.data[start:]
                with hub._lock:
                    cut = hub.drop_after.get(path)
                    if cut is not None and cut > start and hub.num_drops.get(path, 1) > 0:
                        hub.num_drops[path] = hub.num_drops.get(path, 1) - 1
                    else:
                        cut = None
                if cut is not None:
                    self.wfile.write(body[:cut - start])
                    self.wfile.flush()
                    with hub._lock:
                        hub.bytes_sent[path] = hub.bytes_sent.get(path, 0) + cut - start
                    self.close_connection = True
                    self.connection.shutdown(2)  # the body ends early: the client sees the peer close
                    return
                try:
                    pause = hub.slow_file.get(path)
                    if pause is None:
                        self.wfile.write(body)
                    else:
                        for i in range(0, len(body), 2**20):
                            self.wfile.write(body[i:i + 2**20])
                            self.wfile.flush()
                            time.sleep(pause)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (e.g. its disk is full)
                    self.close_connection = True
                    return
                with hub._lock:
                    hub.bytes_sent[path] = hub.bytes_sent.get(path, 0) + len(body)

        return Handler
