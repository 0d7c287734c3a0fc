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


def bridge_netns_unavailable() -> str | None:
    """Why named namespaces joined by a bridge (``ip netns``, veth, bridge) cannot be made here."""
    reason = netns_unavailable()
    if reason:
        return reason
    name = f"omlx-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"'ip netns add' is not permitted here: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "-n", name, "link", "add", "br0", "type", "bridge"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"cannot create a bridge in a namespace: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class BridgedNamespaces:
    """``num_nodes`` network namespaces on one bridge, like machines on one LAN switch.

    A hub namespace holds the bridge; node ``i`` gets namespace ``<prefix>-n<i>`` with ``lo`` and
    ``eth0`` = ``10.77.0.<10+i>/24`` (a veth whose other end is on the bridge), multicast on (mDNS).
    Nothing is added to the host's own namespace; ``close()`` deletes every namespace, which
    removes the links too. Processes started with ``popen`` are killed on ``close()``.
    """

    SUBNET = "10.77.0"

    def __init__(self, num_nodes: int, prefix: str | None = None) -> None:
        self.prefix = prefix or f"omlx{os.getpid()}"
        self.hub = f"{self.prefix}-hub"
        self.names = [f"{self.prefix}-n{i}" for i in range(num_nodes)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._ns_add(self.hub)
            self._ip(self.hub, "link", "add", "br0", "type", "bridge")
            self._ip(self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                self.add_node(i, ns)
        except BaseException:
            self.close()
            raise

    def address(self, i: int) -> str:
        return f"{self.SUBNET}.{10 + i}"

    def add_node(self, i: int, ns: str) -> None:
        self._ns_add(ns)
        host_end = f"v{i}"
        self._ip(self.hub, "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._ip(self.hub, "link", "set", host_end, "master", "br0")
        self._ip(self.hub, "link", "set", host_end, "up")
        self._ip(ns, "link", "set", "lo", "up")
        self._ip(ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        self._ip(ns, "link", "set", "eth0", "multicast", "on")
        self._ip(ns, "link", "set", "eth0", "up")
        # mDNS sends to 224.0.0.251; with no default route the kernel needs this one.
        self._ip(ns, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def popen(self, i: int, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``cmd`` inside node ``i``'s namespace, output to ``log``."""
        f = open(log, "w")
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, start_new_session=True)
        f.close()
        self.procs.append(proc)
        return proc

    def run(self, i: int, cmd: list[str], timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` to completion inside node ``i``'s namespace."""
        return subprocess.run(["ip", "netns", "exec", self.names[i], *cmd], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def _ns_add(self, ns: str) -> None:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # a leftover of a killed run
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, text=True)
        self._made.append(ns)

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        r = subprocess.run(["ip", "-n", ns, *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ip -n {ns} {' '.join(args)}: {r.stderr.strip()}")


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
