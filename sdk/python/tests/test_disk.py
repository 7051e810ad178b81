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
