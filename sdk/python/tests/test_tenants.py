"""Tenants: a key of one tenant sees only that tenant's sandboxes; another
tenant's sandbox answers as a missing one; quotas refuse with
CapacityExhausted; a tenant's key cannot administer."""

from __future__ import annotations

import os

import pytest

import shoal
from shoal import Sandbox


def _key(server, name: str, tenant: str, scopes: str = "sandboxes,layers:read") -> str:
    r = server.cli("key", "create", "--name", name, "--tenant", tenant, "--scope", scopes)
    return r.stdout.strip()


@pytest.fixture
def keys(server):
    suffix = str(os.getpid())
    a, b = f"py-a-{suffix}", f"py-b-{suffix}"
    ka, kb = _key(server, a, a), _key(server, b, b)
    yield ka, kb, b
    server.cli("key", "rm", a, b, check=False)
    server.cli("tenant", "set", b, "--max-sandboxes", "0", check=False)


def test_tenant_sees_only_its_sandboxes(server, keys) -> None:
    ka, kb, tenant_b = keys
    with Sandbox.create(base=server.base, api_key=ka, timeout=120) as sb:
        assert [s.sandbox_id for s in Sandbox.list(api_key=ka)] == [sb.sandbox_id]
        assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=kb)]
        with pytest.raises(shoal.SandboxNotFound):
            Sandbox.connect(sb.sandbox_id, api_key=kb)
        assert Sandbox.kill(sb.sandbox_id, api_key=kb) is False
        assert sb.commands.run("echo mine").stdout == "mine\n"  # untouched
        # The admin key (the default) sees it.
        assert sb.sandbox_id in [s.sandbox_id for s in Sandbox.list()]
    # Quotas: at most one sandbox for tenant B.
    server.cli("tenant", "set", tenant_b, "--max-sandboxes", "1")
    with Sandbox.create(base=server.base, api_key=kb, timeout=120):
        with pytest.raises(shoal.CapacityExhausted, match="max-sandboxes"):
            Sandbox.create(base=server.base, api_key=kb, timeout=120)
    # Scopes: a tenant's key is not an admin's.
    r = server.cli("--api-key", kb, "key", "ls", check=False)
    assert r.returncode != 0 and "permission_denied" in r.stderr
