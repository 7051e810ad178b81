"""Monitoring: one sample of the node's load and of each sandbox's memory,
CPU time and idle time, as ``shoal top`` and the dashboard show them.

    from shoal import monitor

    st = monitor.status()
    for s in st.sandboxes:
        print(s.sandbox_id, s.state, s.memory_bytes, s.idle_seconds)
    st2 = monitor.status()
    print(monitor.cpu_percent(st, st2))   # {sandbox_id: percent of one core}

A tenant's key gets its own sandboxes and no node figures (``nodes`` is
empty). Through a cluster's control replica, ``nodes`` are every node (with
``state`` and ``heartbeat_at``) and each sandbox names its ``node``. CPU figures are cumulative; ``cpu_percent`` turns two samples into
rates. ``astatus`` is the asyncio form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional

__all__ = ["Status", "NodeStatus", "SandboxUsage", "status", "astatus", "cpu_percent"]


def _i(d: Dict[str, Any], k: str) -> int:
    return int(d.get(k) or 0)


def _time(s: Optional[str]) -> Optional[datetime]:
    if not s:
        return None
    s = s.rstrip("Z")
    if "." in s:
        head, frac = s.split(".", 1)
        s = head + "." + frac[:6]
    return datetime.fromisoformat(s + "+00:00")


@dataclass
class NodeStatus:
    name: str
    cpus: int
    load: List[float]
    memory_total_bytes: int
    memory_available_bytes: int
    sandbox_memory_bytes: int  # limits of the sandboxes not paused (what admission counts)
    sandbox_millicpu: int
    sandboxes: int
    creates_total: int  # successful creates since serve started
    cpu_usec: int  # the host's busy CPU time since boot
    # "up"; through a cluster's control replica also "unreachable" (registered,
    # not answering) and "down" (its lease ended): then the figures are those of
    # its last capacity report.
    state: str = "up"
    heartbeat_at: Optional[datetime] = None  # in a cluster: its last report to etcd
    url: str = ""  # in a cluster: its API's URL
    # The host's swap, where a pause puts sandboxes' anonymous memory (zram:
    # serve --zram-size set it up); 0 total: pauses reclaim file pages only.
    swap_total_bytes: int = 0
    swap_free_bytes: int = 0
    swap_zram: bool = False

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "NodeStatus":
        return cls(name=d.get("name", ""), cpus=int(d.get("cpus") or 0),
                   load=[float(d.get(k) or 0) for k in ("load1", "load5", "load15")],
                   memory_total_bytes=_i(d, "memoryTotalBytes"), memory_available_bytes=_i(d, "memoryAvailableBytes"),
                   sandbox_memory_bytes=_i(d, "sandboxMemoryBytes"), sandbox_millicpu=_i(d, "sandboxMillicpu"),
                   sandboxes=_i(d, "sandboxes"), creates_total=_i(d, "createsTotal"), cpu_usec=_i(d, "cpuUsec"),
                   state=d.get("state") or "up", heartbeat_at=_time(d.get("heartbeatAt")), url=d.get("url", ""),
                   swap_total_bytes=_i(d, "swapTotalBytes"), swap_free_bytes=_i(d, "swapFreeBytes"),
                   swap_zram=bool(d.get("swapZram", False)))


@dataclass
class SandboxUsage:
    sandbox_id: str
    state: str
    backend: str
    tenant: str
    created_at: Optional[datetime]
    memory_limit_bytes: int
    millicpu: int
    memory_bytes: int  # charged to its cgroup now; -1 unknown
    cpu_usec: int  # CPU time used since it started; -1 unknown
    idle_seconds: float
    commands_running: int
    node: str = ""  # the node it is on (a NodeStatus name); state "lost" when that node is down

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "SandboxUsage":
        return cls(sandbox_id=d.get("id", ""), state=d.get("state", ""), backend=d.get("backend", ""), tenant=d.get("tenant", ""),
                   created_at=_time(d.get("createdAt")), memory_limit_bytes=_i(d, "memoryLimitBytes"), millicpu=_i(d, "millicpu"),
                   memory_bytes=_i(d, "memoryBytes"), cpu_usec=_i(d, "cpuUsec"), idle_seconds=_i(d, "idleMs") / 1000,
                   commands_running=int(d.get("commandsRunning") or 0), node=d.get("node", ""))


@dataclass
class Status:
    time: Optional[datetime]
    nodes: List[NodeStatus] = field(default_factory=list)
    sandboxes: List[SandboxUsage] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Status":
        return cls(time=_time(d.get("time")), nodes=[NodeStatus.from_json(x) for x in d.get("nodes") or []],
                   sandboxes=[SandboxUsage.from_json(x) for x in d.get("sandboxes") or []])


def cpu_percent(before: Status, after: Status) -> Dict[str, float]:
    """Each sandbox's CPU use between two samples, in percent of one core
    (sandboxes in both samples whose counters are known)."""
    if before.time is None or after.time is None:
        return {}
    dt = (after.time - before.time).total_seconds()
    prev = {s.sandbox_id: s.cpu_usec for s in before.sandboxes}
    out: Dict[str, float] = {}
    for s in after.sandboxes:
        p = prev.get(s.sandbox_id)
        if dt > 0 and p is not None and p >= 0 and s.cpu_usec >= p:
            out[s.sandbox_id] = (s.cpu_usec - p) / 1e6 / dt * 100
    return out


def status(api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> Status:
    """One sample (MonitorService.GetStatus)."""
    from ._sync.transport import transport_for

    r = transport_for(api_key=api_key, url=url).call("MonitorService", "GetStatus", {}, idempotent=True, request_timeout=request_timeout)
    return Status.from_json(r)


async def astatus(api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> Status:
    """One sample, asyncio."""
    from ._async.transport import transport_for

    r = await transport_for(api_key=api_key, url=url).call("MonitorService", "GetStatus", {}, idempotent=True, request_timeout=request_timeout)
    return Status.from_json(r)
