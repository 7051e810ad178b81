"""FnCall: one-shot code execution, judged like an online judge.

    from shoal import fncall

    r = fncall.run(language="python", code="print(int(input()) * 2)",
                   tests=[("21", "42"), ("1", "2")], limits={"cpu_time_ms": 1000})
    r.verdict            # "OK", or "WA", "TLE", "MLE", "RE", "OLE", "CE", "SE"
    [t.verdict for t in r.tests]

    results = fncall.run_batch([dict(language="python", code=c, stdin="") for c in codes], concurrency=32)

The server compiles once, runs every test under CPU, wall, memory, output
and process limits, and returns a verdict per test and overall; calls are
served from warm pools. ``await fncall.arun(...)``, ``arun_batch`` and
``alanguages`` are the asyncio forms. A call has no side effects outside
its throw-away box, so it is retried like any idempotent call (e.g. when the
node is at capacity).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._protocol import parse_memory
from .exceptions import InvalidArgument

__all__ = [
    "Limits",
    "TestCase",
    "Execution",
    "RunResult",
    "Language",
    "run",
    "run_batch",
    "languages",
    "arun",
    "arun_batch",
    "alanguages",
]

_COMPARE = {"exact": "COMPARE_EXACT", "whitespace": "COMPARE_WHITESPACE", "float": "COMPARE_FLOAT", "lines": "COMPARE_LINES"}
_ISOLATION = {"cgroup": "ISOLATION_CGROUP", "sandbox": "ISOLATION_SANDBOX"}


@dataclass
class Limits:
    """Per-test limits; 0 means the server's default (2 s CPU, 2×CPU+1 s wall,
    256 MiB, 1 MiB of output, 64 processes)."""

    cpu_time_ms: int = 0
    wall_time_ms: int = 0
    memory: Union[str, int] = 0  # bytes or "256M"
    output_bytes: int = 0
    processes: int = 0

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.cpu_time_ms:
            out["cpuTimeMs"] = str(int(self.cpu_time_ms))
        if self.wall_time_ms:
            out["wallTimeMs"] = str(int(self.wall_time_ms))
        mem = parse_memory(self.memory) if self.memory else 0
        if mem:
            out["memoryBytes"] = str(mem)
        if self.output_bytes:
            out["outputBytes"] = str(int(self.output_bytes))
        if self.processes:
            out["processes"] = int(self.processes)
        return out


@dataclass
class TestCase:
    """One test: its stdin and, if given, the expected stdout."""

    __test__ = False  # not a pytest test class

    stdin: str = ""
    expected: Optional[str] = None  # None: any output is OK (limits and exit code are judged)
    name: str = ""
    compare: Optional[str] = None  # "exact", "whitespace", "float", "lines"; None: the call's

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"stdin": self.stdin}
        if self.expected is not None:
            out["expected"] = self.expected
        if self.name:
            out["name"] = self.name
        if self.compare:
            out["compare"] = _enum(self.compare, _COMPARE, "compare")
        return out


@dataclass
class Execution:
    """One process: the compile step or a test."""

    name: str
    verdict: str
    stdout: str
    stderr: str
    exit_code: int
    signal: str = ""
    cpu_ms: float = 0.0
    wall_ms: float = 0.0
    memory_bytes: int = 0
    message: str = ""  # why the verdict
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.verdict == "OK"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Execution":
        return cls(
            name=d.get("name", ""),
            verdict=_verdict(d.get("verdict")),
            stdout=_text(d.get("stdout")),
            stderr=_text(d.get("stderr")),
            exit_code=int(d.get("exitCode") or 0),
            signal=d.get("signal", ""),
            cpu_ms=float(d.get("cpuMs") or 0),
            wall_ms=float(d.get("wallMs") or 0),
            memory_bytes=int(d.get("memoryBytes") or 0),
            message=d.get("message", ""),
            stdout_truncated=bool(d.get("stdoutTruncated")),
            stderr_truncated=bool(d.get("stderrTruncated")),
        )


@dataclass
class RunResult:
    """A judged call: the overall verdict (CE, SE, or the first non-OK test's, else OK)."""

    verdict: str
    tests: List[Execution]
    compile: Optional[Execution] = None
    error: str = ""  # SE: why the call could not be judged
    queue_ms: float = 0.0
    total_ms: float = 0.0
    sandbox_id: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.verdict == "OK"

    @property
    def stdout(self) -> str:
        """The first test's stdout (the only one of a plain run)."""
        return self.tests[0].stdout if self.tests else ""

    @property
    def stderr(self) -> str:
        return self.tests[0].stderr if self.tests else ""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RunResult":
        c = d.get("compile")
        return cls(
            verdict=_verdict(d.get("verdict")),
            tests=[Execution.from_json(t) for t in d.get("tests") or []],
            compile=Execution.from_json(c) if c else None,
            error=d.get("error", ""),
            queue_ms=float(d.get("queueMs") or 0),
            total_ms=float(d.get("totalMs") or 0),
            sandbox_id=d.get("sandboxId", ""),
            raw=dict(d),
        )


@dataclass
class Language:
    """A language the server runs, and whether its layers are there."""

    name: str
    source_file: str
    compile: List[str]
    run: List[str]
    available: bool
    unavailable_reason: str = ""
    template: str = ""
    base: str = ""
    toolkits: List[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Language":
        return cls(
            name=d.get("name", ""),
            source_file=d.get("sourceFile", ""),
            compile=list(d.get("compile") or []),
            run=list(d.get("run") or []),
            available=bool(d.get("available")),
            unavailable_reason=d.get("unavailableReason", ""),
            template=d.get("template", ""),
            base=d.get("base", ""),
            toolkits=list(d.get("toolkits") or []),
        )


def _verdict(v: Any) -> str:
    if not v:
        return "UNSPECIFIED"
    return str(v)[len("VERDICT_") :] if str(v).startswith("VERDICT_") else str(v)


def _text(v: Any) -> str:
    return base64.b64decode(v).decode("utf-8", errors="replace") if v else ""


def _enum(v: str, table: Mapping[str, str], what: str) -> str:
    try:
        return table[v.lower()]
    except (KeyError, AttributeError):
        raise InvalidArgument(f"{what} {v!r} must be one of {', '.join(table)}") from None


TestArg = Union[TestCase, Mapping[str, Any], Tuple[str, Optional[str]], str]


def _test(t: TestArg) -> Dict[str, Any]:
    if isinstance(t, TestCase):
        return t.to_json()
    if isinstance(t, str):
        return TestCase(stdin=t).to_json()
    if isinstance(t, tuple):
        return TestCase(stdin=t[0], expected=t[1] if len(t) > 1 else None).to_json()
    if isinstance(t, Mapping):
        return TestCase(**t).to_json()
    raise InvalidArgument(f"a test is a TestCase, a dict, a (stdin, expected) tuple or a stdin string, not {type(t).__name__}")


def request(
    language: str,
    code: str,
    *,
    stdin: Optional[str] = None,
    tests: Optional[Sequence[TestArg]] = None,
    files: Optional[Mapping[str, Union[str, bytes]]] = None,
    compare: Optional[str] = None,
    float_tolerance: float = 0.0,
    compile_options: Optional[Sequence[str]] = None,
    args: Optional[Sequence[str]] = None,
    limits: Union[Limits, Mapping[str, Any], None] = None,
    stop_on_failure: bool = False,
    isolation: Optional[str] = None,
) -> Dict[str, Any]:
    """The RunRequest JSON of one call (the keyword arguments of :func:`run`)."""
    if not language:
        raise InvalidArgument("language is required (see languages())")
    if stdin is not None and tests:
        raise InvalidArgument("give either stdin (one run) or tests, not both")
    body: Dict[str, Any] = {"language": language, "source": code}
    if stdin:
        body["stdin"] = stdin
    if tests:
        body["tests"] = [_test(t) for t in tests]
    if files:
        body["files"] = [
            {"path": p, "content": base64.b64encode(c.encode() if isinstance(c, str) else bytes(c)).decode()} for p, c in files.items()
        ]
    if compare:
        body["compare"] = _enum(compare, _COMPARE, "compare")
    if float_tolerance:
        body["floatTolerance"] = float(float_tolerance)
    if compile_options:
        body["compileOptions"] = list(compile_options)
    if args:
        body["args"] = list(args)
    if limits:
        lim = limits if isinstance(limits, Limits) else Limits(**limits)
        body["limits"] = lim.to_json()
    if stop_on_failure:
        body["stopOnFailure"] = True
    if isolation:
        body["isolation"] = _enum(isolation, _ISOLATION, "isolation")
    return body


# --- blocking ---


def run(
    language: str,
    code: str,
    *,
    stdin: Optional[str] = None,
    tests: Optional[Sequence[TestArg]] = None,
    files: Optional[Mapping[str, Union[str, bytes]]] = None,
    compare: Optional[str] = None,
    float_tolerance: float = 0.0,
    compile_options: Optional[Sequence[str]] = None,
    args: Optional[Sequence[str]] = None,
    limits: Union[Limits, Mapping[str, Any], None] = None,
    stop_on_failure: bool = False,
    isolation: Optional[str] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> RunResult:
    """Judge one call and return its result.

    :param language: ``"python"``, ``"bash"``, ``"c"``, ``"cpp"``, ``"go"``
        or any language the server is configured with (:func:`languages`).
    :param code: the source, written to the language's source file.
    :param stdin: one run with this stdin (when ``tests`` is not given).
    :param tests: test cases: :class:`TestCase`, dicts of its fields,
        ``(stdin, expected)`` tuples or stdin strings; compiled once, run one by one.
    :param files: extra files in the working directory, ``{"data/in.txt": "..."}``.
    :param compare: ``"exact"``, ``"whitespace"`` (default), ``"float"``, ``"lines"``.
    :param limits: :class:`Limits` or a dict of its fields, per test.
    :param isolation: ``"cgroup"`` (warm, shared sandbox) or ``"sandbox"`` (one of its own).
    """
    from ._sync.transport import transport_for

    body = request(
        language, code, stdin=stdin, tests=tests, files=files, compare=compare, float_tolerance=float_tolerance,
        compile_options=compile_options, args=args, limits=limits, stop_on_failure=stop_on_failure, isolation=isolation,
    )  # fmt: skip
    t = transport_for(api_key=api_key, url=url)
    return RunResult.from_json(t.call("FnCallService", "Run", body, idempotent=True, request_timeout=_timeout(request_timeout, t)))


def run_batch(
    calls: Sequence[Mapping[str, Any]],
    concurrency: int = 0,
    on_result: Optional[Callable[[int, RunResult], Any]] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> List[RunResult]:
    """Judge many calls (each a dict of :func:`run`'s keyword arguments), at
    most ``concurrency`` at a time (0: the node's capacity).

    Results stream back as each call is judged (``on_result(index, result)``);
    the list returned is in the order of ``calls``. A call that cannot be
    judged gets verdict ``"SE"`` and the reason in ``error``; it never fails
    the batch.
    """
    from ._sync.transport import transport_for

    body = {"calls": [request(**c) for c in calls], "concurrency": int(concurrency)}
    t = transport_for(api_key=api_key, url=url)
    out: List[Optional[RunResult]] = [None] * len(calls)
    for msg in t.stream("FnCallService", "RunBatch", body, idempotent=True, request_timeout=_timeout(request_timeout, t)):
        i, r = int(msg.get("index") or 0), RunResult.from_json(msg.get("result") or {})
        out[i] = r
        if on_result is not None:
            on_result(i, r)
    return [r if r is not None else RunResult(verdict="SE", tests=[], error="no result for this call") for r in out]


def languages(api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> List[Language]:
    """The languages the server runs (``available`` says whether their layers exist)."""
    from ._sync.transport import transport_for

    r = transport_for(api_key=api_key, url=url).call("FnCallService", "ListLanguages", {}, idempotent=True, request_timeout=request_timeout)
    return [Language.from_json(x) for x in r.get("languages") or []]


def _timeout(request_timeout: Optional[float], t: Any) -> float:
    # A call waits for capacity and runs its tests: allow well past the default.
    return request_timeout if request_timeout is not None else max(300.0, t.config.request_timeout)


# --- asyncio ---


async def arun(
    language: str,
    code: str,
    *,
    stdin: Optional[str] = None,
    tests: Optional[Sequence[TestArg]] = None,
    files: Optional[Mapping[str, Union[str, bytes]]] = None,
    compare: Optional[str] = None,
    float_tolerance: float = 0.0,
    compile_options: Optional[Sequence[str]] = None,
    args: Optional[Sequence[str]] = None,
    limits: Union[Limits, Mapping[str, Any], None] = None,
    stop_on_failure: bool = False,
    isolation: Optional[str] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> RunResult:
    """:func:`run` for asyncio."""
    from ._async.transport import transport_for

    body = request(
        language, code, stdin=stdin, tests=tests, files=files, compare=compare, float_tolerance=float_tolerance,
        compile_options=compile_options, args=args, limits=limits, stop_on_failure=stop_on_failure, isolation=isolation,
    )  # fmt: skip
    t = transport_for(api_key=api_key, url=url)
    return RunResult.from_json(await t.call("FnCallService", "Run", body, idempotent=True, request_timeout=_timeout(request_timeout, t)))


async def arun_batch(
    calls: Sequence[Mapping[str, Any]],
    concurrency: int = 0,
    on_result: Optional[Callable[[int, RunResult], Any]] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> List[RunResult]:
    """:func:`run_batch` for asyncio (``on_result`` may be a coroutine function)."""
    import inspect

    from ._async.transport import transport_for

    body = {"calls": [request(**c) for c in calls], "concurrency": int(concurrency)}
    t = transport_for(api_key=api_key, url=url)
    out: List[Optional[RunResult]] = [None] * len(calls)
    async for msg in t.stream("FnCallService", "RunBatch", body, idempotent=True, request_timeout=_timeout(request_timeout, t)):
        i, r = int(msg.get("index") or 0), RunResult.from_json(msg.get("result") or {})
        out[i] = r
        if on_result is not None:
            x = on_result(i, r)
            if inspect.isawaitable(x):
                await x
    return [r if r is not None else RunResult(verdict="SE", tests=[], error="no result for this call") for r in out]


async def alanguages(api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> List[Language]:
    """:func:`languages` for asyncio."""
    from ._async.transport import transport_for

    r = await transport_for(api_key=api_key, url=url).call("FnCallService", "ListLanguages", {}, idempotent=True, request_timeout=request_timeout)
    return [Language.from_json(x) for x in r.get("languages") or []]
