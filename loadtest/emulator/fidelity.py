"""Fidelity check: an emulator's measured TTFT against its profile's modelled prefill time.

    python -m loadtest.emulator.fidelity [--profile NAME] [--time-scale X] [--sizes 1024,4096,...]

Starts one emulator process on a free loopback port, sends isolated streaming completions (one
at a time, fresh random prompts, then each prompt again to hit the cache) and prints, per size,
the modelled prefill (`StepProfile.isolated_prefill_s`) beside the client-measured time to the
first SSE event, in model milliseconds (real time x time scale). Medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from loadtest.engine import load_profile
from loadtest.ports import free_port
from prompt_normalizer.bench import git_sha


@dataclass(frozen=True, slots=True)
class TtftSample:
    """One measured request: time to the first SSE event and the cached tokens it reported."""

    ttft_s: float
    cached_tokens: int


def random_prompt(n_chars: int, rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n_chars))


def measure_ttft(client: httpx.Client, base_url: str, prompt: str, model: str) -> TtftSample:
    """Stream one completion; time from sending to the first `data:` event (client side)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    cached = -1
    first_s: float | None = None
    began = time.perf_counter()
    with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if first_s is None:
                first_s = time.perf_counter() - began
            if '"prompt_tokens_details"' in line:
                cached = int(line.split('"cached_tokens":', 1)[1].split("}", 1)[0])
    if first_s is None:
        raise RuntimeError("no SSE event received")
    return TtftSample(first_s, cached)


def measure_tpot(client: httpx.Client, base_url: str, prompt: str, model: str, max_tokens: int) -> float:
    """Mean time between the first and the last token event of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    stamps: list[float] = []
    with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    if len(stamps) != max_tokens:
        raise RuntimeError(f"expected {max_tokens} token events, got {len(stamps)}")
    return (stamps[-1] - stamps[0]) / (max_tokens - 1)


def modelled_tpot_s(profile_name: str, prompt_tokens: int, max_tokens: int) -> float:
    """Mean modelled decode step of one request alone: context grows by one token per step."""
    profile = load_profile(profile_name)
    steps = [profile.step_time_s(1, 1, prompt_tokens + 1 + j, 0.0) for j in range(max_tokens - 1)]
    return sum(steps) / len(steps)


@contextlib.contextmanager
def emulator_process(*args: str) -> Iterator[str]:
    """Run `python -m loadtest.emulator` on a free port until the block exits (killed by PID)."""
    port = free_port()
    cmd = [sys.executable, "-m", "loadtest.emulator", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError("emulator exited during startup")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("emulator did not become healthy in 20 s")
            time.sleep(0.1)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.emulator.fidelity", description=__doc__)
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--sizes", default="256,1024,4096,10000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(args.seed)
    sha = git_sha()
    print(
        f"profile={profile.name} time_scale={args.time_scale} repeats={args.repeats} "
        f"seed={args.seed} git={sha}"
    )
    print("| prompt tokens | cached | modelled ms | measured ms, median (best) | median - modelled ms |")
    print("|---:|---:|---:|---:|---:|")
    with (
        emulator_process(
            "--profile", args.profile, "--time-scale", str(args.time_scale), "--model", "fid"
        ) as base,
        httpx.Client(timeout=60) as client,
    ):
        measure_ttft(client, base, random_prompt(64, rng), "fid")  # warm up the connection and code paths
        for n in sizes:
            cold: list[TtftSample] = []
            warm: list[TtftSample] = []
            for _ in range(args.repeats):
                prompt = random_prompt(n, rng)
                cold.append(measure_ttft(client, base, prompt, "fid"))
                warm.append(measure_ttft(client, base, prompt, "fid"))
            for label, samples in (("cold", cold), ("cached", warm)):
                cached = samples[0].cached_tokens
                modelled_ms = profile.isolated_prefill_s(n - cached, cached) * 1000
                measured_ms = statistics.median(s.ttft_s for s in samples) * 1000 * args.time_scale
                best_ms = min(s.ttft_s for s in samples) * 1000 * args.time_scale
                print(
                    f"| {n} | {cached} ({label}) | {modelled_ms:.1f} | {measured_ms:.1f} ({best_ms:.1f}) | "
                    f"{measured_ms - modelled_ms:+.1f} |"
                )
        print()
        print("| prompt tokens | output tokens | modelled TPOT ms | measured TPOT ms, median |")
        print("|---:|---:|---:|---:|")
        for n in (1024, 8192):
            out = 100
            tpots = [measure_tpot(client, base, random_prompt(n, rng), "fid", out) for _ in range(3)]
            modelled = modelled_tpot_s(args.profile, n, out) * 1000
            measured = statistics.median(tpots) * 1000 * args.time_scale
            print(f"| {n} | {out} | {modelled:.2f} | {measured:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
