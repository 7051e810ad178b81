"""shoal.fncall against a real server, with a `sh` language on the busybox
base (configured by the server fixture). Skips while the server has no
FnCallService."""

from __future__ import annotations

import asyncio
from typing import List, Tuple

import httpx
import pytest

import shoal
from shoal import fncall

from .conftest import CLUSTER, skip_unless_implemented


@pytest.fixture(scope="module")
def sh(server) -> str:
    skip_unless_implemented("FnCallService", fncall.languages)
    langs = {l.name: l for l in fncall.languages()}
    assert "sh" in langs, sorted(langs)
    if not langs["sh"].available:
        pytest.fail(f"sh is not available: {langs['sh'].unavailable_reason}")
    return "sh"


def test_plain_run(sh, server) -> None:
    r = fncall.run(language=sh, code="read x; echo $((x * 2)); echo note >&2", stdin="21\n")
    assert r.ok and r.verdict == "OK" and r.stdout == "42\n" and r.stderr == "note\n"
    assert r.tests[0].exit_code == 0 and r.tests[0].wall_ms > 0 and r.total_ms > 0
    # Counted on /metrics by language and verdict, with its latency (a
    # node's: a control replica does not count FnCall runs).
    if CLUSTER:
        return
    m = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer " + server.api_key}, timeout=30).text
    assert 'shoal_fncall_runs_total{language="sh",verdict="OK"}' in m and 'shoal_fncall_run_seconds_count{language="sh"}' in m


def test_tests_and_verdicts(sh) -> None:
    code = "read x; echo $((x * x))"
    r = fncall.run(language=sh, code=code, tests=[("3", "9"), ("4", "16"), fncall.TestCase(stdin="5", expected="24", name="bad")])
    assert r.verdict == "WA" and [t.verdict for t in r.tests] == ["OK", "OK", "WA"] and r.tests[2].name == "bad"
    assert r.tests[2].message
    assert fncall.run(language=sh, code="exit 3", stdin="").verdict == "RE"
    tle = fncall.run(language=sh, code="while :; do :; done", stdin="", limits={"cpu_time_ms": 300})
    assert tle.verdict == "TLE"
    stop = fncall.run(language=sh, code="exit 1", tests=["a", "b"], stop_on_failure=True)
    assert [t.verdict for t in stop.tests] == ["RE", "SKIPPED"]


def test_files_args_and_compare(sh) -> None:
    r = fncall.run(
        language=sh, code='cat data/in.txt; echo "$@"', files={"data/in.txt": "from a file\n"}, args=["x", "y"],
        tests=[("", "from a file x y")], compare="whitespace",
    )  # fmt: skip
    assert r.ok, r
    with pytest.raises(shoal.InvalidArgument):
        fncall.run(language=sh, code="true", compare="fuzzy")
    with pytest.raises(shoal.InvalidArgument):
        fncall.run(language="no-such-language", code="true", stdin="")


def test_batch(sh) -> None:
    seen: List[Tuple[int, str]] = []
    calls = [dict(language=sh, code=f"echo {i}", tests=[("", str(i if i != 3 else 99))]) for i in range(8)]
    calls.append(dict(language="no-such-language", code="true"))
    rs = fncall.run_batch(calls, concurrency=4, on_result=lambda i, r: seen.append((i, r.verdict)))
    assert [r.verdict for r in rs[:8]] == ["OK", "OK", "OK", "WA", "OK", "OK", "OK", "OK"]
    assert rs[8].verdict == "SE" and rs[8].error  # a bad call does not fail the batch
    assert sorted(i for i, _ in seen) == list(range(9))


def test_async(sh) -> None:
    async def main() -> None:
        rs = await asyncio.gather(*[fncall.arun(language=sh, code=f"echo {i}", stdin="") for i in range(8)])
        assert [r.stdout for r in rs] == [f"{i}\n" for i in range(8)]
        b = await fncall.arun_batch([dict(language=sh, code="echo hi", stdin="")] * 3)
        assert [r.stdout for r in b] == ["hi\n"] * 3
        assert "sh" in [l.name for l in await fncall.alanguages()]
        await shoal.aclose()

    asyncio.run(main())
