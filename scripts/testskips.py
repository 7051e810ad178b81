#!/usr/bin/python3
"""The skipped tests of a scripts/test run, and whether each may skip.

  go test -json ... | scripts/testskips.py gotest SKIPS
      prints go test's usual (non-verbose) output from its -json events:
      package lines (ok, FAIL, ?, build errors) and the output of each
      failed test, nothing of the passed ones; appends each skipped test
      to SKIPS as "PACKAGE TEST: REASON". Exit status: that of go test
      (1 when a package failed).

  scripts/testskips.py pytest LOG SKIPS
      appends pytest's skips (its -rs summary lines "SKIPPED [N]
      FILE:LINE: REASON" in LOG) to SKIPS as "FILE:LINE (N tests):
      REASON".

  scripts/testskips.py summary SKIPS ALLOWED
      prints every skipped test group with its reason, grouped by reason,
      and fails (exit 1) when a skip matches none of the regular
      expressions in ALLOWED (test/skips-allowed: one per line, searched
      in each skip's line; # comments).
"""

from __future__ import annotations

import json
import re
import sys
from collections import OrderedDict
from typing import Dict, List, Tuple

LOG_LINE = re.compile(r"^\s+\S+\.go:\d+: ?(.*)$")


def skip_reason(lines: List[str]) -> str:
    """The message of t.Skip: the last log line (file.go:N: ...) before
    the "--- SKIP" line, with its continuation lines."""
    reason: List[str] = []
    for line in lines:
        s = line.rstrip("\n")
        if s.lstrip().startswith(("=== ", "--- SKIP", "--- PASS", "--- FAIL")):
            continue
        m = LOG_LINE.match(s)
        if m:
            reason = [m.group(1)]
        elif reason and s.startswith("        "):
            reason.append(s.strip())
    return " ".join(reason) or "(no reason given)"


def gotest(skips_path: str) -> int:
    out = sys.stdout
    buf: Dict[Tuple[str, str], List[str]] = {}
    done: Dict[Tuple[str, str], str] = {}
    skipped: List[str] = []
    failed = False
    for raw in sys.stdin:
        try:
            ev = json.loads(raw)
        except ValueError:
            out.write(raw)  # not an event: go's own message (a build error)
            continue
        action = ev.get("Action", "")
        pkg = ev.get("Package") or ev.get("ImportPath", "")
        test = ev.get("Test")
        if action == "build-output":
            out.write(ev.get("Output", ""))
            continue
        if action == "build-fail":
            failed = True
            continue
        if not test:
            if action == "output":
                if ev.get("Output") not in ("PASS\n", "testing: warning: no tests to run\n"):
                    out.write(ev.get("Output", ""))
            elif action == "fail":
                failed = True
                # A panic or a timeout: the tests that never ended hold it.
                for key, lines in buf.items():
                    if key[0] == pkg and key not in done:
                        out.writelines(lines)
            out.flush()
            continue
        key = (pkg, test)
        if action == "output":
            buf.setdefault(key, []).append(ev.get("Output", ""))
        elif action in ("pass", "fail", "skip"):
            done[key] = action
            lines = buf.get(key, [])
            if action == "fail":
                out.writelines(l for l in lines if not l.startswith(("=== RUN", "=== PAUSE", "=== CONT", "=== NAME")))
                out.flush()
            elif action == "skip":
                parent = test.rsplit("/", 1)[0] if "/" in test else ""
                if not (parent and done.get((pkg, parent)) == "skip"):
                    skipped.append(f"{pkg} {test}: {skip_reason(lines)}")
            buf.pop(key, None)
    with open(skips_path, "a") as f:
        for s in skipped:
            f.write(s + "\n")
    return 1 if failed else 0


PYTEST_SKIP = re.compile(r"^SKIPPED \[(\d+)\] (\S+?:\d+): (.*)$")


def pytest(log_path: str, skips_path: str) -> int:
    with open(log_path, errors="replace") as f, open(skips_path, "a") as out:
        for line in f:
            m = PYTEST_SKIP.match(line.rstrip("\n"))
            if m:
                n, where, reason = m.groups()
                out.write(f"{where} ({n} test{'s' if n != '1' else ''}): {reason}\n")
    return 0


def summary(skips_path: str, allowed_path: str) -> int:
    allowed: List[re.Pattern[str]] = []
    with open(allowed_path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                allowed.append(re.compile(line))
    try:
        with open(skips_path) as f:
            skips = [l.rstrip("\n") for l in f if l.strip()]
    except FileNotFoundError:
        skips = []
    # Grouped by reason: "REASON" -> ["PACKAGE TEST", ...].
    groups: "OrderedDict[str, List[str]]" = OrderedDict()
    for s in skips:
        who, _, reason = s.partition(": ")
        groups.setdefault(reason, []).append(who)
    bad = [s for s in skips if not any(p.search(s) for p in allowed)]
    print(f"== skipped: {len(skips)} test groups, {len(groups)} reasons (allowed: {allowed_path})")
    for reason, who in groups.items():
        mark = "   " if all(any(p.search(f"{w}: {reason}") for p in allowed) for w in who) else "NOT ALLOWED "
        print(f"  {mark}{reason}")
        for w in who:
            print(f"        {w}")
    if bad:
        print(f"== {len(bad)} skips not on the allowed list ({allowed_path}): install what they need, or list them there with why")
        for s in bad:
            print(f"  {s}")
        return 1
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "gotest":
        return gotest(sys.argv[2])
    if len(sys.argv) == 4 and sys.argv[1] == "pytest":
        return pytest(sys.argv[2], sys.argv[3])
    if len(sys.argv) == 4 and sys.argv[1] == "summary":
        return summary(sys.argv[2], sys.argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
