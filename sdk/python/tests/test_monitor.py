"""monitor.status: the node's load and each sandbox's memory, CPU time and
idle time, as shoal top and the dashboard show them."""

from __future__ import annotations

import os
import time

import pytest

import shoal
from shoal import monitor


def _host_swap() -> tuple:
    """The host's swap total in bytes, and whether a zram device is part of it."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("SwapTotal:")) * 1024
    with open("/proc/swaps") as f:
        zram = any(line.startswith("/dev/zram") for line in f)
    return (total, zram)


def test_status(server, container_sb) -> None:
    h = container_sb.commands.run("while :; do :; done", background=True)
    try:
        first = monitor.status()
        assert len(first.nodes) == 1 and first.nodes[0].cpus >= 1 and first.nodes[0].memory_total_bytes > 0
        mine = [s for s in first.sandboxes if s.sandbox_id == container_sb.sandbox_id]
        assert mine and mine[0].state == "running" and mine[0].memory_bytes > 0 and mine[0].commands_running == 1
        assert first.nodes[0].state == "up" and mine[0].node == first.nodes[0].name
        # The host's swap, as /proc/meminfo has it (serve --zram-size auto
        # sets one up), read around the sample: a shared host may change it.
        swap = [_host_swap()]
        node = monitor.status().nodes[0]
        swap.append(_host_swap())
        assert (node.swap_total_bytes, node.swap_zram) in swap, (node, swap)
        assert 0 <= node.swap_free_bytes <= node.swap_total_bytes
        deadline = time.monotonic() + 60
        while True:  # CPU time shows once the loop is scheduled (a loaded host: a few samples)
            time.sleep(0.5)
            later = monitor.status()
            pct = monitor.cpu_percent(first, later).get(container_sb.sandbox_id, 0)
            if pct > 1:
                break
            assert time.monotonic() < deadline, f"no CPU use by a busy loop: {later}"
    finally:
        h.kill()


def test_status_of_a_tenant(server, container_sb) -> None:
    name = f"py-mon-{os.getpid()}"
    key = server.cli("key", "create", "--name", name, "--tenant", name, "--scope", "sandboxes").stdout.strip()
    try:
        st = monitor.status(api_key=key)
        assert st.nodes == [] and st.sandboxes == []  # not the admin's sandbox, no node figures
        key2 = server.cli("key", "create", "--name", name + "-l", "--tenant", name, "--scope", "layers:read").stdout.strip()
        with pytest.raises(shoal.PermissionDenied):
            monitor.status(api_key=key2)
    finally:
        server.cli("key", "rm", name, name + "-l", check=False)
