"""Idempotent create (client_key) and templates (environments). Skips while
the wire definition does not declare them."""

from __future__ import annotations

import uuid

import pytest

import shoal
from shoal import Sandbox

from .conftest import skip_unless_proto


def test_client_key_makes_create_idempotent(server) -> None:
    skip_unless_proto("client_key", "idempotent create")
    key = f"rollout-17/env-{uuid.uuid4().hex[:6]}"
    a = Sandbox.create(base=server.base, client_key=key)
    try:
        b = Sandbox.create(base=server.base, client_key=key)  # a trainer retrying after a crash
        assert b.sandbox_id == a.sandbox_id
        other = Sandbox.create(base=server.base, client_key=key + "-other")
        assert other.sandbox_id != a.sandbox_id
        other.kill()
    finally:
        a.kill()
    c = Sandbox.create(base=server.base, client_key=key)  # the key's sandbox is gone: a new one
    assert c.sandbox_id != a.sandbox_id
    c.kill()


def test_creates_without_a_key_are_distinct(server) -> None:
    # The SDK gives each create its own key (so it can be retried safely).
    a = Sandbox.create(base=server.base)
    b = Sandbox.create(base=server.base)
    assert a.sandbox_id != b.sandbox_id
    a.kill()
    b.kill()


def test_template(server) -> None:
    skip_unless_proto("CreateEnvironment", "templates")
    name = f"sdk-env-{uuid.uuid4().hex[:6]}"
    server.cli("env", "create", name, "--base", server.base)
    try:
        with Sandbox.create(name) as sb:  # E2B style: the template is the first argument
            assert sb.info.layers[-1].ref == server.base or sb.info.layers[-1].digest
            assert sb.commands.run("echo templated").stdout == "templated\n"
        with pytest.raises((shoal.NotFound, shoal.InvalidArgument)) as e:
            Sandbox.create(template="no-such-env")
        assert "no-such-env" in str(e.value)
    finally:
        server.cli("env", "rm", name, check=False)
