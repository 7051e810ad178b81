"""Environments: named stacks of layers (one base, then workspaces and
toolkits) that sandboxes are created from, ``Sandbox.create(template=name)``.

    from shoal import environments, Sandbox

    environments.create("click-task", base="debian:12", workspaces=["click:main"], toolkits=["pytest:7"])
    with Sandbox.create(template="click-task") as sb:
        sb.commands.run("cd /work/click && python3 -m pytest -q")

The references are stored as given and resolved at each create, so moving
a tag (``layers.build`` or ``layers.tag``) upgrades every later sandbox of
the environment; ``Environment.resolved`` says what they name now. An
image an environment names is kept by ``layers.gc()`` and refused by
``layers.rm()``. ``acreate``, ``alist``, ``aget`` and ``arm`` are the
asyncio forms.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .exceptions import InvalidArgument
from .models import Environment, Layer

__all__ = ["create", "list", "get", "rm", "remove", "acreate", "alist", "aget", "arm", "aremove"]


def _refs(refs: Optional[Sequence[Any]], what: str) -> List[str]:
    if refs is None:
        return []
    if isinstance(refs, (str, Layer)):
        raise InvalidArgument(f"{what} is a list of layer references")
    return [r.pinned if isinstance(r, Layer) else str(r) for r in refs]


def _create_body(
    name: str, base: Any, workspaces: Optional[Sequence[Any]], toolkits: Optional[Sequence[Any]], replace: bool, backend: Optional[str] = None, if_revision: int = 0
) -> Dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise InvalidArgument("an environment name is required ([a-z0-9][a-z0-9._-]{0,127})")
    if not base:
        raise InvalidArgument("an environment needs a base layer")
    body: Dict[str, Any] = {"name": name, "base": base.pinned if isinstance(base, Layer) else str(base)}
    ws, tk = _refs(workspaces, "workspaces"), _refs(toolkits, "toolkits")
    if ws:
        body["workspaces"] = ws
    if tk:
        body["toolkits"] = tk
    if replace:
        body["replace"] = True
    if backend:
        body["backend"] = backend
    if if_revision:
        if not replace or not isinstance(if_revision, int) or if_revision < 0:
            raise InvalidArgument("if_revision is a positive revision (Environment.revision), for a replace")
        body["ifRevision"] = str(if_revision)
    return body


def _name(name: Any) -> str:
    if isinstance(name, Environment):
        return name.name
    if not isinstance(name, str) or not name:
        raise InvalidArgument("an environment name is required")
    return name


# --- blocking ---


def _t(api_key: Optional[str], url: Optional[str]) -> Any:
    from ._sync.transport import transport_for

    return transport_for(api_key=api_key, url=url)


def create(
    name: str,
    base: str,
    workspaces: Optional[Sequence[str]] = None,
    toolkits: Optional[Sequence[str]] = None,
    *,
    replace: bool = False,
    backend: Optional[str] = None,
    if_revision: int = 0,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> Environment:
    """Create the environment ``name`` (``[a-z0-9][a-z0-9._-]{0,127}``).

    :param base: the base layer reference (a tag follows upgrades; a
        digest, or a :class:`~shoal.Layer` which is taken by digest, pins it).
    :param workspaces: workspace references (the first wins where they overlap).
    :param toolkits: toolkit references (the first wins; above the workspaces).
    :param replace: replace an environment of that name instead of raising
        :class:`~shoal.AlreadyExists`.
    :param backend: the backend its sandboxes (and E2B sandboxes of this
        template) run on unless their create names one (``"microvm"``, say;
        default: the node's); one the node does not offer raises
        :class:`~shoal.InvalidArgument`.
    :param if_revision: with ``replace``, on a cluster: replace it only if
        it is still at this :attr:`Environment.revision` (someone else's
        change in between raises :class:`~shoal.FailedPrecondition`).
    Every reference must resolve now (:class:`~shoal.LayerNotFound` otherwise).
    """
    body = _create_body(name, base, workspaces, toolkits, replace, backend, if_revision)
    return Environment.from_json(
        _t(api_key, url).call("LayerService", "CreateEnvironment", body, idempotent=replace and not if_revision, request_timeout=request_timeout)
    )


def list(api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> List[Environment]:  # noqa: A001
    """Every environment, with what its references resolve to now."""
    r = _t(api_key, url).call("LayerService", "ListEnvironments", {}, idempotent=True, request_timeout=request_timeout)
    return [Environment.from_json(x) for x in r.get("environments") or []]


def get(name: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> Environment:
    """One environment (:class:`~shoal.NotFound` if there is none of that name)."""
    r = _t(api_key, url).call("LayerService", "GetEnvironment", {"name": _name(name)}, idempotent=True, request_timeout=request_timeout)
    return Environment.from_json(r)


def rm(name: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> None:
    """Delete an environment (sandboxes created from it keep running on
    their layers; :class:`~shoal.NotFound` if there is none of that name)."""
    _t(api_key, url).call("LayerService", "DeleteEnvironment", {"name": _name(name)}, idempotent=True, request_timeout=request_timeout)


remove = rm


# --- asyncio ---


def _at(api_key: Optional[str], url: Optional[str]) -> Any:
    from ._async.transport import transport_for

    return transport_for(api_key=api_key, url=url)


async def acreate(
    name: str,
    base: str,
    workspaces: Optional[Sequence[str]] = None,
    toolkits: Optional[Sequence[str]] = None,
    *,
    replace: bool = False,
    backend: Optional[str] = None,
    if_revision: int = 0,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> Environment:
    """:func:`create` for asyncio."""
    body = _create_body(name, base, workspaces, toolkits, replace, backend, if_revision)
    return Environment.from_json(
        await _at(api_key, url).call("LayerService", "CreateEnvironment", body, idempotent=replace and not if_revision, request_timeout=request_timeout)
    )


async def alist(api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> List[Environment]:
    """:func:`list` for asyncio."""
    r = await _at(api_key, url).call("LayerService", "ListEnvironments", {}, idempotent=True, request_timeout=request_timeout)
    return [Environment.from_json(x) for x in r.get("environments") or []]


async def aget(name: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> Environment:
    """:func:`get` for asyncio."""
    r = await _at(api_key, url).call("LayerService", "GetEnvironment", {"name": _name(name)}, idempotent=True, request_timeout=request_timeout)
    return Environment.from_json(r)


async def arm(name: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> None:
    """:func:`rm` for asyncio."""
    await _at(api_key, url).call("LayerService", "DeleteEnvironment", {"name": _name(name)}, idempotent=True, request_timeout=request_timeout)


aremove = arm
