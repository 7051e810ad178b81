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


def test_tenants_own_layers_and_environments(server) -> None:
    """A tenant's layers and environments are its own: another tenant's key
    lists, inspects, creates from, moves and removes none of them (not found
    or permission denied); both use the admin's shared base and change it
    not. The async half answers the same."""
    import asyncio

    suffix = str(os.getpid())
    a, b = f"pyl-a-{suffix}", f"pyl-b-{suffix}"
    w = "sandboxes,layers:read,layers:write"
    ka, kb = _key(server, a, a, w), _key(server, b, b, w)
    try:
        mine = shoal.layers.tag(server.base, "bbase:1", api_key=kb)
        assert mine.layer.tenant == b and not mine.layer.shared
        env = shoal.environments.create("benv", "bbase:1", api_key=kb)
        assert env.tenant == b
        assert "bbase" not in [l.name for l in shoal.layers.list(api_key=ka)]
        assert "benv" not in [e.name for e in shoal.environments.list(api_key=ka)]
        assert any(l.shared and l.ref == server.base for l in shoal.layers.list(api_key=ka))
        for ref in ("bbase:1", f"{b}/bbase:1"):
            with pytest.raises(shoal.NotFound):
                shoal.layers.get(ref, api_key=ka)
            with pytest.raises(shoal.NotFound):
                shoal.layers.rm(ref, api_key=ka)
            # B's qualified name is, for A, no layer of its own or shared:
            # an image reference (docker.io/B/bbase:1), which a create
            # pulls; offline, the pull is unavailable. Either way nothing
            # of B's answers.
            with pytest.raises((shoal.NotFound, shoal.Unavailable)):
                Sandbox.create(base=ref, api_key=ka, timeout=60)
        with pytest.raises(shoal.NotFound):
            Sandbox.create(template="benv", api_key=ka, timeout=60)
        with pytest.raises(shoal.PermissionDenied):
            shoal.layers.tag(server.base, f"{b}/bbase:1", api_key=ka)
        with pytest.raises(shoal.PermissionDenied):
            shoal.layers.rm(server.base, api_key=ka)
        with pytest.raises(shoal.NotFound):
            asyncio.run(shoal.environments.aget("benv", api_key=ka))
        assert asyncio.run(shoal.environments.aget("benv", api_key=kb)).base == "bbase:1"
        # B's own environment is B's to create from.
        with Sandbox.create(template="benv", api_key=kb, timeout=60) as sb:
            assert sb.sandbox_id
    finally:
        # The admin names B's as b/NAME.
        for rm, name in ((shoal.environments.rm, f"{b}/benv"), (shoal.layers.rm, f"{b}/bbase:1")):
            try:
                rm(name)
            except shoal.ShoalError:
                pass
        server.cli("key", "rm", a, b, check=False)
