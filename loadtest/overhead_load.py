"""Processes and load for `kvgate bench overhead`: child processes stopped by PID, the CPU time of a
process tree from /proc, a seeded chat workload, wrk or a built-in aiohttp load generator, and the
minimal pass-through proxy that compares upstream HTTP clients.

    python -m loadtest.overhead_load --child-proxy aiohttp|httpx --port P --upstream URL
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request, Response

from loadtest import static_backend

API_KEY = "sk-kvgate-bench"
BODY_GROUPS = 8
TURNS_PER_GROUP = 8
CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One load run against one URL at one concurrency."""

    concurrency: int
    requests: int
    errors: int
    duration_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float | None = None


# ---------------------------------------------------------------- processes


def spawn(argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            cwd=REPO,
        )


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """Stop the child's whole process group by its PID: TERM, then KILL after 10 s."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_ready(
    url: str, proc: subprocess.Popen[bytes] | None, log_path: Path, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"exited with {proc.returncode} before ready: {tail}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=1.0) as resp,
        ):
            if resp.status < 300:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")


def tree_cpu_by_process(root_pid: int) -> dict[int, tuple[str, float]]:
    """Each live process of the tree under `root_pid` (itself included): its name and its
    utime+stime in seconds (from /proc)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        cpu[pid] = (name, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    tree: dict[int, tuple[str, float]] = {}
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        if pid in cpu:
            tree[pid] = cpu[pid]
        todo.extend(children.get(pid, []))
    return tree


def tree_cpu_s(root_pid: int) -> float:
    """utime+stime of a process and all its live descendants, in seconds (from /proc)."""
    return sum(cpu for _, cpu in tree_cpu_by_process(root_pid).values())


# ---------------------------------------------------------------- workload


def chat_bodies(seed: int, model: str = static_backend.MODEL, stream: bool = False) -> list[str]:
    """8 shared ~1.2 KB system prompts x 8 user turns, deterministic for a seed; with `stream`,
    streamed requests that ask for the usage chunk (as the OpenAI SDKs do for token counts)."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        for _ in range(400)
    ]
    bodies = []
    for g in range(BODY_GROUPS):
        system = f"You are assistant {g}. " + " ".join(rng.choice(words) for _ in range(200))
        for t in range(TURNS_PER_GROUP):
            user = f"Question {t}: " + " ".join(rng.choice(words) for _ in range(12))
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            body: dict[str, object] = {"model": model, "messages": messages, "max_tokens": 1}
            if stream:
                body["max_tokens"] = static_backend.STREAM_DELTAS
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            bodies.append(json.dumps(body))
    return bodies


def wrk_script(bodies: Sequence[str]) -> str:
    items = ",\n".join(f"[==[{b}]==]" for b in bodies)
    return f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {API_KEY}"
local bodies = {{
{items}
}}
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format(nil, "/v1/chat/completions", nil, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KVGATE_RESULT %d %d %d %.1f %.1f\\n", summary.requests,
    e.connect + e.read + e.write + e.status + e.timeout, summary.duration,
    latency:percentile(50), latency:percentile(99)))
end
"""


def run_wrk(url: str, script: Path, concurrency: int, duration_s: float) -> LoadResult:
    argv = [
        "wrk",
        "-t1",
        f"-c{concurrency}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "5s",
        "-s",
        str(script),
        url,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("KVGATE_RESULT")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result: {out.stdout[-500:]} {out.stderr[-500:]}")
    requests, errors, duration_us, p50_us, p99_us = line.split()[1:]
    dur = int(duration_us) / 1e6
    return LoadResult(
        concurrency,
        int(requests),
        int(errors),
        dur,
        int(requests) / dur,
        float(p50_us) / 1e3,
        float(p99_us) / 1e3,
    )


async def builtin_load(url: str, bodies: Sequence[str], concurrency: int, duration_s: float) -> LoadResult:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    encoded = [b.encode() for b in bodies]
    target = url.rstrip("/") + "/v1/chat/completions"
    stop_at = time.monotonic() + duration_s
    max_samples = 5_000_000

    async def worker(session: aiohttp.ClientSession, offset: int) -> None:
        nonlocal errors
        i = offset
        while time.monotonic() < stop_at and len(latencies) < max_samples:
            i += 1
            t0 = time.perf_counter()
            try:
                async with session.post(target, data=encoded[i % len(encoded)], headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            latencies.append(time.perf_counter() - t0)
            errors += 0 if ok else 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=5)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session, k * 7) for k in range(concurrency)))
    dur = time.monotonic() - started
    latencies.sort()
    n = len(latencies)
    p50 = latencies[n // 2] * 1e3 if n else float("nan")
    p99 = latencies[min(n - 1, int(n * 0.99))] * 1e3 if n else float("nan")
    return LoadResult(concurrency, n, errors, dur, n / dur, p50, p99)


# ---------------------------------------------------------------- pass-through proxy child


def run_proxy(client: str, port: int, upstream: str) -> None:
    """A minimal FastAPI pass-through: read the body, POST it upstream, return the bytes."""
    import uvicorn

    forward: dict[str, Callable[[bytes], Awaitable[tuple[int, bytes]]]] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        target = upstream + "/v1/chat/completions"
        headers = {"content-type": "application/json"}
        if client == "aiohttp":
            import aiohttp

            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256), timeout=aiohttp.ClientTimeout(total=30)
            )

            async def post_aiohttp(body: bytes) -> tuple[int, bytes]:
                async with session.post(target, data=body, headers=headers) as r:
                    return r.status, await r.read()

            forward["post"] = post_aiohttp
            yield
            await session.close()
        else:
            import httpx

            hc = httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=30)

            async def post_httpx(body: bytes) -> tuple[int, bytes]:
                r = await hc.post(target, content=body, headers=headers)
                return r.status_code, r.content

            forward["post"] = post_httpx
            yield
            await hc.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(b"")

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> Response:
        status, body = await forward["post"](await req.body())
        return Response(body, status_code=status, media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _child_main() -> int:
    parser = argparse.ArgumentParser(description="bench overhead child process")
    parser.add_argument("--child-proxy", choices=("aiohttp", "httpx"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    run_proxy(args.child_proxy, args.port, args.upstream.rstrip("/"))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main())
