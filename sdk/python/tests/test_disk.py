"""A sandbox's disk: `disk=` sizes its writable layer, a file system of its
own; writing past it fails with ENOSPC inside, and other sandboxes go on."""

from __future__ import annotations

import pytest

import shoal
from shoal import Sandbox

from .conftest import skip_unless_proto


def test_disk_bounds_the_writable_layer(server) -> None:
    skip_unless_proto("disk_bytes", "disk limits")
    with Sandbox.create(base=server.base, disk="32M") as sb:
        if sb.info.disk_bytes == 0:
            pytest.skip("this server cannot limit disks (see its log: 'sandbox disks: NOT limited')")
        assert sb.info.disk_bytes == 32 << 20
        assert sb.get_info().disk_bytes == 32 << 20
        r = sb.commands.run("dd if=/dev/zero of=/root/fill bs=1M count=64; stat -c %s /root/fill")
        assert "No space left on device" in r.stderr
        written = int(r.stdout.split()[-1])
        assert 16 << 20 < written <= 32 << 20
        with Sandbox.create(base=server.base) as other:  # the node's default disk
            assert other.info.disk_bytes > 32 << 20
            r2 = other.commands.run("dd if=/dev/zero of=/root/fill bs=1M count=40 2>&1 && stat -c %s /root/fill")
            assert r2.exit_code == 0 and r2.stdout.split()[-1] == str(40 << 20)


def test_disk_is_validated(server) -> None:
    skip_unless_proto("disk_bytes", "disk limits")
    with pytest.raises(shoal.InvalidArgument):
        Sandbox.create(base=server.base, disk=-1)
    with pytest.raises(shoal.InvalidArgument):
        Sandbox.create(base=server.base, disk="1X")
    with pytest.raises(shoal.InvalidArgument) as e:
        Sandbox.create(base=server.base, disk="1M")  # below the node's minimum
    assert "disk" in str(e.value)


def test_log_budget_prunes_oldest_output(server) -> None:
    # Command logs live on the host, outside the disk: past its log budget a
    # sandbox loses its oldest output (ended commands first); reading it
    # raises LogPruned with the offset to go on from.
    skip_unless_proto("log_budget_bytes", "log budgets")
    with Sandbox.create(base=server.base, log_budget="1M") as sb:
        assert sb.info.log_budget_bytes == 1 << 20
        steps = []
        for i in range(3):  # 600 kB each: two do not fit in 1 MiB
            h = sb.commands.run(f"head -c 600000 /dev/zero | tr '\\0' x; echo step-{i}", background=True)
            r = h.wait()
            assert r.exit_code == 0 and r.stdout.endswith(f"step-{i}\n")
            steps.append(h.id)
        with pytest.raises(shoal.LogPruned) as e:
            sb.commands.connect(steps[0]).wait()
        assert e.value.code == "out_of_range" and e.value.offset is not None and e.value.offset > 600000
        r = sb.commands.connect(steps[0], offset=e.value.offset).wait()
        assert r.exit_code == 0 and r.stdout == ""  # its exit status stays
        assert sb.commands.connect(steps[2]).wait().stdout.endswith("step-2\n")
    with pytest.raises(shoal.InvalidArgument):
        Sandbox.create(base=server.base, log_budget="1K")
