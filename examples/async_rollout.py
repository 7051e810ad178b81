#!/usr/bin/env python3
"""An async mini-rollout: 64 sandboxes at once, each running a small agent loop.

Each "agent" is given a task (make `answer` print N squared), and on every
turn it writes a candidate solution file, runs the task's test in the
sandbox, and reads the result file back; a failed test sends it round again
with the next candidate, as a model would revise its answer. The sandboxes
are killed at the end (also on Ctrl-C or an error).

    python3 examples/async_rollout.py                 # 64 rollouts on SHOAL_URL's server
    python3 examples/async_rollout.py -n 8 --base debian:12

Needs the SDK (`pip install --no-build-isolation ./sdk/python`, or run from
the repository: the script adds sdk/python to its path) and a base layer
with a POSIX shell (`busybox:1` or `debian:12`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sdk", "python"))

import shoal  # noqa: E402
from shoal import AsyncSandbox  # noqa: E402

TEST = """#!/bin/sh
# The task's test: does the solution print {want}?
got=$(sh /work/solution.sh 2>&1)
if [ "$got" = "{want}" ]; then echo PASS > /work/result; else echo "FAIL: got '$got', want {want}" > /work/result; fi
"""


def candidates(n: int) -> List[str]:
    """What a (not very good) model proposes, turn after turn."""
    return [
        f"echo $(( {n} + {n} ))",  # wrong: doubles
        f"echo {n}{n}",  # wrong: concatenates
        f"echo $(( {n} * {n} ))",  # right
    ]


async def agent(i: int, base: str, max_turns: int) -> Dict[str, object]:
    t0 = time.monotonic()
    sb = await AsyncSandbox.create(base=base, metadata={"example": "async_rollout", "rollout": str(i)}, timeout=300)
    try:
        await sb.files.write("/work/test.sh", TEST.format(want=i * i), mode=0o755)
        for turn, solution in enumerate(candidates(i)[:max_turns], 1):
            await sb.files.write("/work/solution.sh", solution + "\n")  # the agent's action
            run = await sb.commands.run("/work/test.sh", timeout=30, check=False)  # the environment's step
            result = (await sb.files.read("/work/result")).strip()  # the observation
            if run.exit_code != 0:
                result = f"test crashed ({run.exit_code}): {run.stderr.strip()}"
            if result == "PASS":
                return {"rollout": i, "reward": 1.0, "turns": turn, "seconds": round(time.monotonic() - t0, 3)}
        return {"rollout": i, "reward": 0.0, "turns": max_turns, "last": result, "seconds": round(time.monotonic() - t0, 3)}
    finally:
        await sb.kill()


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=64, help="rollouts (sandboxes), all in flight at once")
    p.add_argument("--base", default=os.environ.get("SHOAL_BASE", "busybox:1"), help="base layer (default busybox:1, or $SHOAL_BASE)")
    p.add_argument("--turns", type=int, default=3)
    args = p.parse_args()

    t0 = time.monotonic()
    try:
        results = await asyncio.gather(*[agent(i, args.base, args.turns) for i in range(args.n)], return_exceptions=True)
    finally:
        # Belt and braces: nothing this example made outlives it.
        for s in await AsyncSandbox.list(metadata={"example": "async_rollout"}):
            await AsyncSandbox.kill(s.sandbox_id)
        await shoal.aclose()
    errors = [r for r in results if isinstance(r, BaseException)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    wall = time.monotonic() - t0
    summary = {
        "rollouts": args.n,
        "solved": sum(1 for r in ok if r["reward"] == 1.0),
        "errors": [f"{type(e).__name__}: {e}" for e in errors][:5],
        "turns_total": sum(int(r["turns"]) for r in ok),
        "wall_seconds": round(wall, 2),
        "rollout_seconds_max": max((float(r["seconds"]) for r in ok), default=0.0),
    }
    print(json.dumps(summary, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
