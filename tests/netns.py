"""Running a real client CLI beside a real omlx server in a loopback-only network namespace.

Nothing a client sends can leave the machine: the namespace has only ``lo``. Tests call
`run_beside_server`, which re-runs this file as ``unshare -n python tests/netns.py ...``; inside,
`main` brings ``lo`` up, starts `omlx serve` (`ServerProcess`, the shared test home), runs the
client, stops the server and exits with the client's status.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def netns_unavailable() -> str | None:
    """Why a loopback-only namespace cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root for 'unshare -n' (a loopback-only network namespace)"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (util-linux / iproute2)"
    r = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"'unshare -n' is not permitted here: {r.stderr.strip()}"
    return None


def run_beside_server(cmd: list[str], *, port: int, cwd: Path, env: dict[str, str] | None = None,
                      server_args: list[str] | None = None, timeout_s: float = 540) -> subprocess.CompletedProcess:
    """Run ``cmd`` (stdin closed) in a new loopback-only namespace with omlx serving on ``port``.

    Returns:
        The completed process: the client's exit status, stdout and stderr (the server's log
        tail is appended to stderr when the client fails).

    Raises:
        AssertionError: still running after ``timeout_s``; the client and the server are
            stopped and the output so far is in the message.
    """
    runner = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--cwd", str(cwd)]
    for a in server_args or []:
        runner.append(f"--server-arg={a}")  # "=" so a value starting with "--" stays a value
    args = ["unshare", "-n", *runner, "--", *cmd]
    proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the runner stops the client and the server
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"{cmd[0]} ran past {timeout_s}s\nstdout:\n{out}\nstderr:\n{err[-8000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cwd", required=True)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the client is killed, the server stopped
    sys.path.insert(0, str(REPO))
    from tests.helpers import ServerProcess

    with ServerProcess(args.server_arg, port=args.port) as server:
        try:
            r = subprocess.run(cmd, cwd=args.cwd, stdin=subprocess.DEVNULL)
        except SystemExit:
            sys.stderr.write(f"\n--- omlx serve log ---\n{server.log()}\n")
            raise
        if r.returncode != 0:
            sys.stderr.write(f"\n--- omlx serve log ---\n{server.log()}\n")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
