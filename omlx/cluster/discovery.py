"""Finding cluster peers: the persisted node id, this node's description, and mDNS (zeroconf).

Owns advertising ``_omlx._tcp.local.`` with this node's id, versions, device and memory figures
and its control port, and browsing for other nodes doing the same. The only module that imports
zeroconf. Discovery is public: it says who is out there, never whom to trust (joining is
authenticated in ``omlx.cluster.control``). mDNS does not cross subnets or VPNs; static peers
(``--peer host:port``) reach the agent without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SERVICE_TYPE = "_omlx._tcp.local."
"""The mDNS service type every omlx node advertises."""

DEFAULT_CONTROL_PORT = 8470
"""TCP port of the node agent's control channel unless configured otherwise."""

_RESOLVE_TIMEOUT_MS = 3000


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node says about itself: in its mDNS TXT record and in the control handshake.

    Attributes:
        node_id: Persisted random id (32 hex digits), stable across restarts.
        hostname: The machine's host name (for people; never used to connect).
        addresses: IPv4 addresses the control channel listens on (non-loopback first).
        control_port: TCP port of the agent's control channel.
        http_port: Port of the HTTP API when this node serves it (``omlx serve --cluster``), else 0.
        omlx_version, mlx_version: Versions; nodes of a pipeline must agree on both.
        backend: ``"cpu"``, ``"gpu"`` (Metal or CUDA): MLX's default device type.
        device: Device name as MLX reports it (e.g. ``"Apple M3 Max"``, ``"AMD EPYC"``).
        total_bytes: Physical RAM (psutil).
        available_bytes: RAM available to new allocations when measured (psutil).
        device_memory_bytes: MLX's recommended working set on a GPU, when MLX reports one; else 0.
        memory_cap_bytes: A configured cap on what omlx may use here; 0 = none.
    """

    node_id: str
    hostname: str = ""
    addresses: tuple[str, ...] = ()
    control_port: int = DEFAULT_CONTROL_PORT
    http_port: int = 0
    omlx_version: str = ""
    mlx_version: str = ""
    backend: str = ""
    device: str = ""
    total_bytes: int = 0
    available_bytes: int = 0
    device_memory_bytes: int = 0
    memory_cap_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["addresses"] = list(self.addresses)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeInfo:
        """Build from a dict (the handshake's JSON); unknown keys are ignored.

        Raises:
            ValueError: ``node_id`` missing or a field of the wrong type.
        """
        if not isinstance(d, dict) or not isinstance(d.get("node_id"), str) or not d["node_id"]:
            raise ValueError("node info without a node_id")
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            try:
                if f.name == "addresses":
                    kwargs[f.name] = tuple(str(a) for a in v)
                elif f.name.endswith("_bytes") or f.name.endswith("_port"):
                    kwargs[f.name] = int(v)
                else:
                    kwargs[f.name] = str(v)
            except (TypeError, ValueError) as e:
                raise ValueError(f"node info field {f.name}: {v!r}") from e
        return cls(**kwargs)

    def to_txt(self) -> dict[str, str]:
        """The mDNS TXT properties (strings; addresses comma-joined; each well under 255 bytes)."""
        return {
            k: ",".join(v) if isinstance(v, list) else str(v)
            for k, v in self.to_dict().items()
        }

    @classmethod
    def from_txt(cls, props: dict[bytes | str, bytes | str | None]) -> NodeInfo:
        """Inverse of ``to_txt`` on the raw properties zeroconf hands back.

        Raises:
            ValueError: No node id, or a malformed number.
        """
        d: dict[str, Any] = {}
        for k, v in props.items():
            key = k.decode() if isinstance(k, bytes) else k
            val = (v.decode() if isinstance(v, bytes) else v) or ""
            d[key] = [a for a in val.split(",") if a] if key == "addresses" else val
        return cls.from_dict(d)


# ---------------------------------------------------------------------------------------------
# Node id


def cluster_dir(base_dir: Path) -> Path:
    """``<base>/cluster``, created 0700 (it holds the node id and possibly the shared secret)."""
    d = base_dir / "cluster"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def write_private_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` created 0600 (never world-readable, not even briefly)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_node_id(base_dir: Path) -> str:
    """This node's id from ``<base>/cluster/node_id``, made (32 random hex digits) on first use.

    The file is created 0600 in a 0700 folder. An unreadable or malformed file is replaced and
    the replacement is logged (the node then joins as a new member).
    """
    path = cluster_dir(base_dir) / "node_id"
    try:
        text = path.read_text().strip()
        if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
            return text
        logger.warning("%s is malformed (%r); making a new node id", path, text[:40])
    except FileNotFoundError:
        pass
    node_id = uuid.uuid4().hex
    write_private_file(path, node_id + "\n")
    logger.info("new cluster node id %s (%s)", node_id, path)
    return node_id


# ---------------------------------------------------------------------------------------------
# This node


def local_addresses() -> list[str]:
    """IPv4 addresses of this machine's up interfaces, non-loopback first (psutil)."""
    import psutil

    stats = psutil.net_if_stats()
    out: list[str] = []
    loop: list[str] = []
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET:
                (loop if a.address.startswith("127.") else out).append(a.address)
    return out + loop


def describe_local_node(
    node_id: str,
    *,
    control_port: int,
    http_port: int = 0,
    memory_cap_bytes: int = 0,
    addresses: list[str] | None = None,
) -> NodeInfo:
    """This node's NodeInfo now: versions, MLX device, psutil memory, addresses."""
    import mlx.core as mx
    import psutil

    from omlx import __version__

    vm = psutil.virtual_memory()
    dev = mx.default_device()
    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except (AttributeError, RuntimeError):  # older MLX, or no device info on this backend
        pass
    device_memory = int(info.get("max_recommended_working_set_size", 0) or 0)
    return NodeInfo(
        node_id=node_id,
        hostname=socket.gethostname(),
        addresses=tuple(addresses if addresses is not None else local_addresses()),
        control_port=control_port,
        http_port=http_port,
        omlx_version=__version__,
        mlx_version=mx.__version__,
        backend="gpu" if dev.type == mx.DeviceType.gpu else "cpu",
        device=str(info.get("device_name") or info.get("architecture") or dev),
        total_bytes=int(vm.total),
        available_bytes=int(vm.available),
        device_memory_bytes=device_memory,
        memory_cap_bytes=memory_cap_bytes,
    )


# ---------------------------------------------------------------------------------------------
# mDNS


@dataclass
class Discovery:
    """Advertise this node and browse for others over mDNS, on the running asyncio loop.

    ``on_peer(info)`` is called (on the loop) for each other node resolved, again when its
    record changes; ``on_gone(node_id)`` when its record is removed. Own records are skipped.

    Attributes:
        info: This node (its TXT record).
        on_peer: Callback for a resolved peer.
        on_gone: Callback for a peer whose record went away (a hint; heartbeats decide membership).
    """

    info: NodeInfo
    on_peer: Callable[[NodeInfo], None]
    on_gone: Callable[[str], None] = lambda _node_id: None
    _aiozc: Any = None
    _browser: Any = None
    _service: Any = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _names: dict[str, str] = field(default_factory=dict)  # service name -> node id

    @property
    def service_name(self) -> str:
        return f"omlx-{self.info.node_id}.{SERVICE_TYPE}"

    async def start(self) -> None:
        """Register the service and start browsing.

        Raises:
            OSError: The mDNS socket cannot be opened (port 5353 in use without SO_REUSEPORT).
        """
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

        self._aiozc = AsyncZeroconf(ip_version=IPVersion.V4Only)
        addrs = [a for a in self.info.addresses if not a.startswith("127.")] or list(
            self.info.addresses
        )
        self._service = AsyncServiceInfo(
            SERVICE_TYPE,
            self.service_name,
            port=self.info.control_port,
            properties=self.info.to_txt(),
            server=f"omlx-{self.info.node_id}.local.",
            parsed_addresses=addrs,
        )
        await self._aiozc.async_register_service(self._service)
        self._browser = AsyncServiceBrowser(
            self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_change]
        )
        logger.info(
            "advertising %s on %s port %d", SERVICE_TYPE, ", ".join(addrs), self.info.control_port
        )

    async def stop(self) -> None:
        """Unregister (peers see the record go) and close the sockets."""
        for t in list(self._tasks):
            t.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._aiozc is not None:
            if self._service is not None:
                try:
                    await self._aiozc.async_unregister_service(self._service)
                except Exception as e:  # already closing: nothing else to do
                    logger.debug("unregister: %s", e)
            await self._aiozc.async_close()
        self._aiozc = self._browser = self._service = None

    async def update(self, info: NodeInfo) -> None:
        """Re-announce with new figures (e.g. available memory)."""
        self.info = info
        if self._aiozc is None or self._service is None:
            return
        self._service.properties = info.to_txt()  # type: ignore[misc]
        await self._aiozc.async_update_service(self._service)

    def _on_change(self, zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        from zeroconf import ServiceStateChange

        if name == self.service_name:
            return
        if state_change is ServiceStateChange.Removed:
            node_id = self._names.pop(name, None)
            if node_id is not None:
                self.on_gone(node_id)
            return
        task = asyncio.get_running_loop().create_task(self._resolve(service_type, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, service_type: str, name: str) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        if self._aiozc is None:
            return
        si = AsyncServiceInfo(service_type, name)
        if not await si.async_request(self._aiozc.zeroconf, _RESOLVE_TIMEOUT_MS):
            logger.debug("could not resolve %s", name)
            return
        try:
            info = NodeInfo.from_txt(dict(si.properties))
        except ValueError as e:
            logger.warning("ignoring %s: bad TXT record (%s)", name, e)
            return
        addrs = si.parsed_addresses()
        if addrs:
            # The addresses mDNS resolved are the ones that reach us; prefer them.
            info = NodeInfo.from_dict({**info.to_dict(), "addresses": addrs, "control_port": si.port})
        if info.node_id == self.info.node_id:
            return
        self._names[name] = info.node_id
        self.on_peer(info)
