"""Trajectories and shell sessions (asyncio API)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Union

from .._concurrency import AsyncLock
from .._protocol import argv, checked, exec_body
from ..exceptions import InvalidArgument, NotFound, SandboxNotFound
from ..models import CommandResult, ShellInfo, ShellResult, TrajectoryInfo

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox


class AsyncTrajectory:
    """An ordered, server-recorded log of command steps under a client-chosen ID.

    ``with sb.trajectory("rollout-17") as t: t.run(cmd)`` numbers the steps
    1, 2, 3, ... in call order. Each step is recorded by the server with its
    request and result; a script that crashed and runs again from the top
    sends the same steps, and every step already recorded returns its
    recorded result (``result.replayed``) without running again, up to
    where the crash happened. A step re-sent with a different request raises
    :class:`TrajectoryDiverged`. Steps are sent one at a time; a step lost to
    a dropped connection is safely re-sent (the server replays it if it ran).
    """

    def __init__(self, sandbox: "AsyncSandbox", trajectory_id: str, start_step: int = 1) -> None:
        if not trajectory_id:
            raise InvalidArgument("a trajectory ID is required")
        if start_step < 1:
            raise InvalidArgument("steps are numbered from 1")
        self._sb = sandbox
        self.id = trajectory_id
        self.next_step = start_step
        self.replayed = 0  # steps answered from the record
        self.executed = 0  # steps run now
        self._lock = AsyncLock()

    async def run(
        self,
        cmd: Union[str, Sequence[str]],
        envs: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
        on_stdout: Optional[Callable[[str], Any]] = None,
        on_stderr: Optional[Callable[[str], Any]] = None,
        stdin: Union[str, bytes, None] = None,
        timeout: Optional[float] = 60.0,
        request_timeout: Optional[float] = None,
        *,
        check: bool = False,
    ) -> CommandResult:
        """Run the next step (same parameters as ``sb.commands.run``; stdin
        must be str/bytes so the step's request is reproducible)."""
        if stdin is not None and not isinstance(stdin, (str, bytes)):
            raise InvalidArgument("a trajectory step's stdin must be str or bytes (it is part of the recorded request)")
        async with self._lock:
            step = self.next_step
            self.next_step += 1
        data = stdin.encode() if isinstance(stdin, str) else stdin
        body = exec_body(self._sb.sandbox_id, argv(cmd), envs=envs, cwd=cwd, stdin=data, timeout=timeout, trajectory_id=self.id, step=step)
        result: CommandResult = await self._sb.commands._exec(
            body, background=False, check=False, on_stdout=on_stdout, on_stderr=on_stderr, request_timeout=request_timeout
        )
        async with self._lock:
            if result.replayed:
                self.replayed += 1
            else:
                self.executed += 1
        return checked(result, check)

    async def info(self, request_timeout: Optional[float] = None) -> TrajectoryInfo:
        """The steps the server recorded under this trajectory."""
        r = await self._sb._transport.call(
            "CommandService", "GetTrajectory", {"sandboxId": self._sb.sandbox_id, "trajectoryId": self.id}, idempotent=True, request_timeout=request_timeout
        )
        return TrajectoryInfo.from_json(r)

    async def __aenter__(self) -> "AsyncTrajectory":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass


class AsyncShell:
    """A named persistent shell: cwd, environment and shell variables carry
    over from one ``run`` to the next (SWE-agent style)."""

    def __init__(self, shells: "AsyncShells", name: str, info: Optional[ShellInfo] = None) -> None:
        self._shells = shells
        self.name = name
        self.info = info

    async def run(self, command: str, timeout: Optional[float] = None, request_timeout: Optional[float] = None, *, check: bool = False) -> ShellResult:
        """Run a command line in the shell; returns its output and exit code.

        :param timeout: seconds after which the command is interrupted
            (Ctrl-C); the shell survives.
        :param check: raise :class:`CommandExitException` on a non-zero exit.
        """
        return await self._shells.run(self.name, command, timeout=timeout, request_timeout=request_timeout, check=check)

    async def delete(self) -> bool:
        """End the shell. False if it did not exist."""
        return await self._shells.delete(self.name)

    kill = delete

    async def __aenter__(self) -> "AsyncShell":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.delete()


class AsyncShells:
    """``sb.shells``: named persistent shell sessions."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    async def _call(self, method: str, body: Dict[str, Any], idempotent: bool, request_timeout: Optional[float] = None) -> Dict[str, Any]:
        return await self._sb._transport.call(
            "CommandService", method, dict(body, sandboxId=self._sb.sandbox_id), idempotent=idempotent, request_timeout=request_timeout
        )

    async def create(
        self,
        name: str = "default",
        cwd: Optional[str] = None,
        envs: Optional[Dict[str, str]] = None,
        shell: Optional[str] = None,
        request_timeout: Optional[float] = None,
        user: Optional[str] = None,
    ) -> AsyncShell:
        """Start a shell (``bash`` if the sandbox has it, else ``sh``, or ``shell``)."""
        body: Dict[str, Any] = {"name": name}
        if cwd:
            body["cwd"] = cwd
        if envs:
            body["env"] = dict(envs)
        if shell:
            body["shell"] = shell
        if user:
            body["user"] = user
        return AsyncShell(self, name, ShellInfo.from_json(await self._call("CreateShell", body, False, request_timeout)))

    def get(self, name: str = "default") -> AsyncShell:
        """A handle on an existing shell (no call is made)."""
        return AsyncShell(self, name)

    async def run(self, name: str, command: str, timeout: Optional[float] = None, request_timeout: Optional[float] = None, *, check: bool = False) -> ShellResult:
        """Run a command line in the shell called ``name``."""
        body: Dict[str, Any] = {"name": name, "command": command}
        if timeout:
            body["timeoutMs"] = str(int(timeout * 1000))
        rt = request_timeout if request_timeout is not None else (timeout or 0) + self._sb._transport.config.request_timeout
        r = await self._call("RunInShell", body, False, rt)
        res = ShellResult(output=r.get("output", ""), exit_code=int(r.get("exitCode") or 0), timed_out=bool(r.get("timedOut")))
        checked(CommandResult(stdout=res.output, stderr="", exit_code=res.exit_code, timed_out=res.timed_out), check)
        return res

    async def list(self, request_timeout: Optional[float] = None) -> List[ShellInfo]:
        """The sandbox's shells."""
        return [ShellInfo.from_json(s) for s in (await self._call("ListShells", {}, True, request_timeout)).get("shells") or []]

    async def delete(self, name: str, request_timeout: Optional[float] = None) -> bool:
        """End a shell. False if there was none by that name."""
        try:
            await self._call("DeleteShell", {"name": name}, True, request_timeout)
            return True
        except SandboxNotFound:
            raise
        except NotFound:
            return False
