#!/usr/bin/env python3
"""Benchmark of the Python SDK; prints JSON.

1. create: the asyncio SDK creating N sandboxes with C in flight (creates/s,
   latency p50/p99), then deleting them with C in flight.
2. overhead: the SDK against raw httpx calls of the same requests
   (GetSandbox, an Exec of `true`, a 1 KiB file write, and a sync Exec),
   one at a time on one sandbox: wall-clock p50 and the client's own CPU
   time per call (time.process_time, i.e. what the SDK costs the trainer).

    python3 sdk/python/bench.py                       # 500 creates, 64 in flight
    python3 sdk/python/bench.py -n 100 -c 16 --base busybox:1 --overhead-n 200

Uses SHOAL_URL / SHOAL_API_KEY (or /var/lib/shoal/admin.key) like the SDK.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import time
from typing import Any, Awaitable, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

import shoal  # noqa: E402
from shoal import AsyncSandbox, Sandbox  # noqa: E402
from shoal._config import ConnectionConfig  # noqa: E402
from shoal._http import _nodelay_transport  # noqa: E402


def pct(xs: List[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]


def ms(x: float) -> float:
    return round(x * 1000, 2)


async def bench_create(n: int, conc: int, base: str) -> Dict[str, Any]:
    sem = asyncio.Semaphore(conc)
    lat: List[float] = []
    sbs: List[AsyncSandbox] = []
    errors: List[str] = []

    async def one(i: int) -> None:
        async with sem:
            t = time.monotonic()
            try:
                sb = await AsyncSandbox.create(base=base, metadata={"bench": "sdk-create"})
            except shoal.ShoalError as e:
                errors.append(f"{type(e).__name__}: {e}")
                return
            lat.append(time.monotonic() - t)
            sbs.append(sb)

    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.gather(*[one(i) for i in range(n)])
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0

    dlat: List[float] = []

    async def kill(sb: AsyncSandbox) -> None:
        async with sem:
            t = time.monotonic()
            await sb.kill()
            dlat.append(time.monotonic() - t)

    d0 = time.monotonic()
    await asyncio.gather(*[kill(sb) for sb in sbs])
    dwall = time.monotonic() - d0
    return {
        "n": n,
        "concurrency": conc,
        "created": len(lat),
        "errors": len(errors),
        "first_errors": errors[:3],
        "wall_s": round(wall, 2),
        "creates_per_s": round(len(lat) / wall, 1) if wall else 0,
        "p50_ms": ms(pct(lat, 50)),
        "p99_ms": ms(pct(lat, 99)),
        "max_ms": ms(max(lat, default=0)),
        "client_cpu_ms_per_create": round(cpu / max(1, n) * 1000, 3),
        "delete": {"wall_s": round(dwall, 2), "deletes_per_s": round(len(dlat) / dwall, 1) if dwall else 0, "p50_ms": ms(pct(dlat, 50)), "p99_ms": ms(pct(dlat, 99))},
    }


async def bench_burst(n: int, conc: int, base: str, hang_after: float = 60.0) -> Dict[str, Any]:
    """Rollouts from the asyncio SDK: create, run `true`, kill; C in flight."""
    sem = asyncio.Semaphore(conc)
    firsts: List[float] = []
    errors: List[str] = []
    counts = {"failures": 0, "hangs": 0, "pooled": 0, "cold": 0}

    async def one(i: int) -> None:
        async with sem:
            t = time.monotonic()
            try:
                sb = await asyncio.wait_for(AsyncSandbox.create(base=base, metadata={"bench": "burst"}), hang_after)
            except asyncio.TimeoutError:
                counts["hangs"] += 1
                errors.append(f"create not answered in {hang_after}s")
                return
            except shoal.ShoalError as e:
                counts["failures"] += 1
                errors.append(f"{type(e).__name__}: {e}")
                return
            counts["pooled" if (sb.info.raw.get("runtime") or {}).get("pooled") == "true" else "cold"] += 1
            try:
                r = await sb.commands.run("true")
                if r.exit_code == 0:
                    firsts.append(time.monotonic() - t)
                else:
                    counts["failures"] += 1
                    errors.append(f"true exited {r.exit_code}")
            except shoal.ShoalError as e:
                counts["failures"] += 1
                errors.append(f"{type(e).__name__}: {e}")
            finally:
                try:
                    await sb.kill()
                except shoal.ShoalError as e:
                    counts["failures"] += 1
                    errors.append(f"kill: {type(e).__name__}: {e}")

    t0 = time.monotonic()
    await asyncio.gather(*[one(i) for i in range(n)])
    wall = time.monotonic() - t0
    return {
        "failures": counts["failures"],
        "hangs": counts["hangs"],
        "first_error": errors[0] if errors else "",
        "create_to_first_exec": {
            "n": len(firsts),
            "p50_ms": ms(pct(firsts, 50)),
            "p95_ms": ms(pct(firsts, 95)),
            "p99_ms": ms(pct(firsts, 99)),
            "max_ms": ms(max(firsts, default=0)),
        },
        "creates_per_second": round(len(firsts) / wall, 1) if wall else 0,
        "pooled": counts["pooled"],
        "cold": counts["cold"],
    }


def _stats(lat: List[float], cpu: List[float]) -> Dict[str, float]:
    return {"p50_ms": ms(pct(lat, 50)), "p99_ms": ms(pct(lat, 99)), "client_cpu_us": round(sum(cpu) / len(cpu) * 1e6, 1)}


async def timed_pair(n: int, sdk: Callable[[], Awaitable[Any]], raw: Callable[[], Awaitable[Any]]) -> Dict[str, Any]:
    """Alternate SDK and raw calls (so load changes hit both alike)."""
    res: Dict[str, Any] = {}
    lat: Dict[str, List[float]] = {"sdk": [], "raw": []}
    cpu: Dict[str, List[float]] = {"sdk": [], "raw": []}
    for i in range(n + 10):
        for name, fn in (("sdk", sdk), ("raw", raw)):
            c, t = time.process_time(), time.monotonic()
            await fn()
            if i >= 10:  # the first ones warm the connection pools
                lat[name].append(time.monotonic() - t)
                cpu[name].append(time.process_time() - c)
    res = compare(_stats(lat["sdk"], cpu["sdk"]), _stats(lat["raw"], cpu["raw"]))
    return res


def timed_pair_sync(n: int, sdk: Callable[[], Any], raw: Callable[[], Any]) -> Dict[str, Any]:
    lat: Dict[str, List[float]] = {"sdk": [], "raw": []}
    cpu: Dict[str, List[float]] = {"sdk": [], "raw": []}
    for i in range(n + 10):
        for name, fn in (("sdk", sdk), ("raw", raw)):
            c, t = time.process_time(), time.monotonic()
            fn()
            if i >= 10:
                lat[name].append(time.monotonic() - t)
                cpu[name].append(time.process_time() - c)
    return compare(_stats(lat["sdk"], cpu["sdk"]), _stats(lat["raw"], cpu["raw"]))


def compare(sdk: Dict[str, float], raw: Dict[str, float]) -> Dict[str, Any]:
    return {
        "sdk": sdk,
        "raw_httpx": raw,
        "overhead_p50_ms": round(sdk["p50_ms"] - raw["p50_ms"], 3),
        "overhead_cpu_us": round(sdk["client_cpu_us"] - raw["client_cpu_us"], 1),
    }


def envelope(obj: Dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">BI", 0, len(data)) + data


def parse_exit(body: bytes) -> int:
    code, i = None, 0
    while i + 5 <= len(body):
        flags, n = struct.unpack_from(">BI", body, i)
        msg = json.loads(body[i + 5 : i + 5 + n] or b"{}")
        i += 5 + n
        if flags & 2:
            if msg.get("error"):
                raise RuntimeError(msg["error"])
        elif "exit" in msg:
            code = int(msg["exit"].get("code") or 0)
    if code is None:
        raise RuntimeError("no exit event")
    return code


async def bench_overhead(n: int, base: str) -> Dict[str, Any]:
    cfg = ConnectionConfig.resolve()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    sb = await AsyncSandbox.create(base=base)
    sid = sb.sandbox_id
    out: Dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(base_url=cfg.url, headers=headers, trust_env=False) as raw:

            async def raw_get() -> None:
                r = await raw.post("/shoal.v1.SandboxService/GetSandbox", json={"id": sid})
                r.raise_for_status()
                r.json()

            out["get_sandbox"] = await timed_pair(n, sb.get_info, raw_get)

            async def sdk_exec() -> None:
                await sb.commands.run(["true"])

            exec_body = envelope({"sandboxId": sid, "args": ["true"], "timeoutMs": "60000"})

            async def raw_exec() -> None:
                r = await raw.post(
                    "/shoal.v1.CommandService/Exec", content=exec_body, headers={"Content-Type": "application/connect+json"}
                )
                assert parse_exit(r.content) == 0

            out["exec_true"] = await timed_pair(n, sdk_exec, raw_exec)

            data = os.urandom(1024)

            async def sdk_write() -> None:
                await sb.files.write("/tmp/bench.bin", data)

            async def raw_write() -> None:
                r = await raw.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/bench.bin"}, content=data)
                r.raise_for_status()

            out["write_1k"] = await timed_pair(n, sdk_write, raw_write)
    finally:
        await sb.kill()

    # The blocking SDK against blocking httpx, for an Exec. The raw client
    # gets the SDK's TCP_NODELAY transport so that the difference is the
    # SDK's own work; stock httpx (Nagle on) is reported beside it.
    ssb = Sandbox.create(base=base)
    try:
        body = envelope({"sandboxId": ssb.sandbox_id, "args": ["true"], "timeoutMs": "60000"})
        nodelay = _nodelay_transport(httpx.Limits(), False)
        with httpx.Client(base_url=cfg.url, headers=headers, trust_env=False, transport=nodelay) as raw_sync, httpx.Client(
            base_url=cfg.url, headers=headers, trust_env=False
        ) as stock:

            def raw_exec_sync(c: httpx.Client = raw_sync) -> None:
                r = c.post("/shoal.v1.CommandService/Exec", content=body, headers={"Content-Type": "application/connect+json"})
                assert parse_exit(r.content) == 0

            out["exec_true_sync"] = timed_pair_sync(n, lambda: ssb.commands.run(["true"]), raw_exec_sync)
            stock_lat = []
            for _ in range(max(10, n // 5)):
                t = time.monotonic()
                raw_exec_sync(stock)
                stock_lat.append(time.monotonic() - t)
            out["exec_true_sync"]["stock_httpx_p50_ms"] = ms(pct(stock_lat, 50))
    finally:
        ssb.kill()
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description="Shoal Python SDK benchmark (JSON on stdout)")
    p.add_argument("-n", type=int, default=500, help="sandboxes to create")
    p.add_argument("-c", type=int, default=64, help="creates in flight")
    p.add_argument("--base", default=os.environ.get("SHOAL_BASE", "debian:12"))
    p.add_argument("--overhead-n", type=int, default=200, help="calls per overhead measurement")
    p.add_argument("--skip-create", action="store_true")
    p.add_argument("--burst", action="store_true", help="only the burst of rollouts (create, run true, kill), as `shoal bench burst` runs it")
    args = p.parse_args()
    if args.burst:
        try:
            print(json.dumps(await bench_burst(args.n, args.c, args.base), indent=2))
        finally:
            await shoal.aclose()
        return
    res: Dict[str, Any] = {
        "sdk": shoal.__version__,
        "python": sys.version.split()[0],
        "httpx": httpx.__version__,
        "base": args.base,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        if not args.skip_create:
            res["create"] = await bench_create(args.n, args.c, args.base)
            # A burst leaves idle pooled connections (up to 16, for 5 s) that
            # httpcore polls on every request; measure the steady state.
            await asyncio.sleep(6)
        res["overhead"] = await bench_overhead(args.overhead_n, args.base)
    finally:
        await shoal.aclose()
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
