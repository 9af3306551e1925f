"""Emulator CPU cost: N concurrent streamed completions against one emulator process.

    python -m loadtest.emulator.capacity [--streams 128] [--max-tokens 200] [--time-scale 1]

Prints wall time, tokens streamed and the emulator process's CPU seconds (user + system, from
/proc) per 1,000 streamed tokens, so a benchmark can tell how many emulated workers and which
time scale one machine sustains. The load generator runs in this process, not in the emulator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.ports import free_port
from prompt_normalizer.bench import git_sha


@dataclass(frozen=True, slots=True)
class CapacityResult:
    wall_s: float
    tokens: int
    emulator_cpu_s: float


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one(client: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> int:
    body = {"model": "cap", "prompt": f"{i:06d}" + "p" * 1000, "max_tokens": max_tokens, "stream": True}
    n = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                n += 1
    return n


async def _drive(base: str, pid: int, streams: int, max_tokens: int) -> CapacityResult:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await _one(client, base, -1, 2)  # warm-up
        cpu0 = _cpu_s(pid)
        began = time.perf_counter()
        counts = await asyncio.gather(*(_one(client, base, i, max_tokens) for i in range(streams)))
        wall = time.perf_counter() - began
        return CapacityResult(wall, sum(counts), _cpu_s(pid) - cpu0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.emulator.capacity", description=__doc__)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--profile", default="llama3-8b-h100")
    args = parser.parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "loadtest.emulator", "--port", str(port), "--model", "cap",
           "--time-scale", str(args.time_scale), "--profile", args.profile]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                print("error: emulator did not start", file=sys.stderr)
                return 1
            time.sleep(0.1)
        res = asyncio.run(_drive(base, proc.pid, args.streams, args.max_tokens))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    sha = git_sha()
    print(f"streams={args.streams} max_tokens={args.max_tokens} time_scale={args.time_scale} "
          f"profile={args.profile} git={sha}")  # fmt: skip
    print(f"wall {res.wall_s:.2f} s, {res.tokens} tokens streamed, emulator CPU {res.emulator_cpu_s:.2f} s = "
          f"{1000 * res.emulator_cpu_s / max(1, res.tokens):.3f} s per 1k tokens")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
