"""`kvgate bench overhead`: what a router in front of an instant backend costs, per request.

Every target forwards non-streaming chat to the same static backend (nginx when installed, else
`loadtest.static_backend`): the backend directly, kvgate (`python -m gateway.cli serve --config`)
with round_robin and with the `cost` policy, sglang-router (from its own venv, see
`loadtest/peers/install.sh`) with round_robin and cache_aware, smg 1.13 (its own venv too) with
cache_aware and prefix_hash, and, with `--upstream-clients`,
a minimal FastAPI pass-through proxy with an aiohttp and with an httpx upstream client. For each
target: req/s and p50/p99 latency at concurrency 32 and 1 (wrk when installed, else a built-in
aiohttp load generator), and the router process tree's CPU time (utime+stime from /proc) per
request. Ratios are against sglang-router and the direct run of the same invocation; when smg
cache_aware ran, a second CPU ratio is against it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest import static_backend
from loadtest.overhead_load import (
    API_KEY,
    REPO,
    LoadResult,
    builtin_load,
    chat_bodies,
    free_port,
    run_wrk,
    spawn,
    stop,
    tree_cpu_s,
    wait_ready,
    wrk_script,
)
from loadtest.peers.launch import peer_bin, smg_argv
from policies.identity import hash_api_key

# ---------------------------------------------------------------- records


@dataclass(slots=True)
class TargetResult:
    """A target's runs, or why it could not run."""

    name: str
    baseline: str | None
    runs: list[LoadResult] = field(default_factory=list)
    missing: str | None = None

    def at(self, concurrency: int) -> LoadResult | None:
        """The run at `concurrency`; with repeats, each field is the median over the repeats."""
        runs = [r for r in self.runs if r.concurrency == concurrency]
        if len(runs) <= 1:
            return runs[0] if runs else None
        cpu = [r.cpu_us_per_request for r in runs if r.cpu_us_per_request is not None]
        return LoadResult(
            concurrency,
            sum(r.requests for r in runs),
            sum(r.errors for r in runs),
            sum(r.duration_s for r in runs),
            statistics.median(r.rps for r in runs),
            statistics.median(r.p50_ms for r in runs),
            statistics.median(r.p99_ms for r in runs),
            statistics.median(cpu) if cpu else None,
        )

    def cpu_rounds(self, concurrency: int) -> list[float | None]:
        """CPU µs per request of each round at `concurrency`, in round order."""
        return [r.cpu_us_per_request for r in self.runs if r.concurrency == concurrency]


def cpu_ratio(target: TargetResult, baseline: TargetResult, concurrency: int) -> float | None:
    """The median over rounds of target CPU / baseline CPU in the same round. Rounds interleave the
    targets, so a round's pair saw the same machine load; CPU per request of a multi-threaded
    router moves with that load (fewer idle wake-ups per request on a busy machine)."""
    pairs = zip(target.cpu_rounds(concurrency), baseline.cpu_rounds(concurrency), strict=False)
    ratios = [a / b for a, b in pairs if a is not None and b]
    return statistics.median(ratios) if ratios else None


@dataclass(frozen=True, slots=True)
class Target:
    """How to start a router in front of the backend; `start` returns (process, base URL) or raises."""

    name: str
    baseline: str | None
    start: Callable[[str, Path], tuple[subprocess.Popen[bytes] | None, str]]


class TargetMissing(RuntimeError):
    """The target cannot run here (not installed, not in this tree); the message says why."""


# ---------------------------------------------------------------- targets


def _backend(kind: str, workdir: Path, stream: bool = False) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    answers = "streamed chat, 16 deltas + usage" if stream else "JSON chat"
    if kind == "nginx":
        prefix = workdir / "nginx"
        prefix.mkdir(exist_ok=True)
        conf = prefix / "nginx.conf"
        conf.write_text(static_backend.nginx_config(str(prefix), port, stream=stream))
        proc = spawn(["nginx", "-c", str(conf), "-p", str(prefix)], workdir / "backend.log")
        name = f"nginx (1 worker process), {answers}"
    else:
        argv = [sys.executable, "-m", "loadtest.static_backend", "--port", str(port)]
        proc = spawn([*argv, "--stream"] if stream else argv, workdir / "backend.log")
        name = f"built-in static backend (loadtest.static_backend, 1 process), {answers}"
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", proc, workdir / "backend.log")
    return proc, url, name


def _sglang_python() -> Path:
    base = Path(os.environ.get("KVGATE_PEERS_DIR", str(Path.home() / ".cache/kvgate/peers")))
    return base / "sglang-router" / "bin" / "python"


def sglang_target(policy: str) -> Target:
    def start(backend: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        python = _sglang_python()
        if not python.exists():
            raise TargetMissing(
                f"sglang-router not installed ({python}): run loadtest/peers/install.sh sglang-router"
            )
        port, metrics_port = free_port(), free_port()
        argv = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", backend, "--policy", policy, "--log-level", "warn"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        log_path = workdir / f"sglang-{policy}.log"
        proc = spawn(argv, log_path)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", proc, log_path)
        return proc, url

    return Target(f"sglang-router {policy}", None, start)


def smg_target(policy: str) -> Target:
    """smg 1.13 (`smg launch`), ready once its worker is registered and healthy."""

    def start(backend: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        exe = peer_bin("smg", "smg")
        if not exe.exists():
            raise TargetMissing(f"smg not installed ({exe}): run loadtest/peers/install.sh smg")
        port, metrics_port = free_port(), free_port()
        log_path = workdir / f"smg-{policy}.log"
        proc = spawn(list(smg_argv(str(exe), port, metrics_port, [backend], policy)), log_path)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/readiness", proc, log_path)
        return proc, url

    return Target(f"smg {policy}", "sglang-router cache_aware", start)


def proxy_target(client: str) -> Target:
    def start(backend: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        port = free_port()
        argv = [sys.executable, "-m", "loadtest.overhead_load", "--child-proxy", client]
        argv += ["--port", str(port), "--upstream", backend]
        log_path = workdir / f"proxy-{client}.log"
        proc = spawn(argv, log_path)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", proc, log_path)
        return proc, url

    return Target(f"pass-through FastAPI + {client}", "sglang-router round_robin", start)


BENCH_SECRET = "kvgate-bench-secret"


def kvgate_config(backend: str, policy_path: Path, port: int, traced: bool = False) -> str:
    """The gateway config (schema of `gateway.config`) for one static worker and the bench key."""
    key_hash = hash_api_key(BENCH_SECRET.encode(), API_KEY)
    return json.dumps(
        {
            "listen": {"host": "127.0.0.1", "port": port},
            "metrics": {"listen": {"host": "127.0.0.1", "port": 0}},  # any free port: runs side by side
            "policy_file": str(policy_path),
            "log_level": "warning",
            "secrets": {"key_hash_secret_env": "KVGATE_KEY_SECRET"},
            "pools": [{"name": "bench", "models": [static_backend.MODEL], "workers": [backend]}],
            "tenants": [{"name": "bench", "api_key_hashes": [key_hash]}],
            "tracing": {"enabled": traced},
        }
    )


def _tracing_env(backend: str) -> dict[str, str]:
    """Spans exported over OTLP/HTTP to the static backend, which answers 200 to the POST as a
    collector would (its CPU is not the router's). Every request is sampled unless the caller's
    environment sets OTEL_TRACES_SAMPLER (and _ARG)."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": backend + "/v1/chat/completions",
        "OTEL_TRACES_SAMPLER": os.environ.get("OTEL_TRACES_SAMPLER", "always_on"),
    }


def kvgate_target(policy: str, baseline: str, traced: bool = False, processes: int = 1) -> Target:
    label = f"{policy} traced" if traced else policy
    if processes > 1:
        label = f"{label} x{processes} processes"
        baseline = f"kvgate {policy}"  # compared with one process of the same policy

    def start(backend: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        port = free_port()
        policy_path = workdir / f"policy-{label.replace(' ', '_')}.yaml"
        policy_path.write_text(f"policy: {policy}\nseed: 0\n")
        config_path = workdir / f"kvgate-{label.replace(' ', '_')}.yaml"
        config_path.write_text(kvgate_config(backend, policy_path, port, traced))
        log_path = workdir / f"kvgate-{label.replace(' ', '_')}.log"
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)]
        if processes > 1:
            argv += ["--processes", str(processes)]  # one port, SO_REUSEPORT, a local nats-server
        env = {"KVGATE_KEY_SECRET": BENCH_SECRET, **(_tracing_env(backend) if traced else {})}
        proc = spawn(argv, log_path, env=env)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/readyz", proc, log_path)
        return proc, url

    return Target(f"kvgate {label}", baseline, start)


def direct_target() -> Target:
    return Target("direct", None, lambda backend, workdir: (None, backend))


# ---------------------------------------------------------------- the benchmark


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything that shapes one run; printed and stored with the results."""

    duration_s: float
    warmup_s: float
    concurrencies: tuple[int, ...]
    seed: int
    backend: str
    load_tool: str
    upstream_clients: bool
    targets: tuple[str, ...]
    repeats: int = 1
    stream: bool = False


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


DEFAULT_TARGETS = (
    "direct",
    "kvgate-rr",
    "kvgate-cost",
    "sglang-rr",
    "sglang-cache_aware",
    "smg-cache_aware",
    "smg-prefix_hash",
)
# kvgate-cost-traced: `tracing.enabled`, every request sampled (needs the `kvgate[otel]` extra).
TARGET_CHOICES = (*DEFAULT_TARGETS, "kvgate-cost-traced")
SMG_BASELINE = "smg cache_aware"  # the second CPU ratio's baseline, when it ran


def build_targets(
    names: Sequence[str], upstream_clients: bool, processes: Sequence[int] = (1,)
) -> list[Target]:
    table: dict[str, Callable[[int], Target]] = {
        "direct": lambda _n: direct_target(),
        "kvgate-rr": lambda n: kvgate_target("round_robin", "sglang-router round_robin", processes=n),
        "kvgate-cost": lambda n: kvgate_target("cost", "sglang-router cache_aware", processes=n),
        "kvgate-cost-traced": lambda n: kvgate_target("cost", "kvgate cost", traced=True, processes=n),
        "sglang-rr": lambda _n: sglang_target("round_robin"),
        "sglang-cache_aware": lambda _n: sglang_target("cache_aware"),
        "smg-cache_aware": lambda _n: smg_target("cache_aware"),
        "smg-prefix_hash": lambda _n: smg_target("prefix_hash"),
    }
    # A kvgate target runs once per `processes` value; the others once.
    targets = [table[name](n) for name in names for n in (processes if name.startswith("kvgate") else (1,))]
    if upstream_clients:
        targets += [proxy_target("aiohttp"), proxy_target("httpx")]
    return targets


def measure(
    target: Target,
    backend_url: str,
    cfg: BenchConfig,
    workdir: Path,
    load: Callable[[str, int, float], LoadResult],
    result: TargetResult,
) -> None:
    """Start the target, warm it up, run every concurrency, stop it; runs are appended to `result`."""
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, url = target.start(backend_url, workdir)
        if cfg.warmup_s > 0:
            load(url, max(cfg.concurrencies), cfg.warmup_s)
        for c in cfg.concurrencies:
            cpu0 = tree_cpu_s(proc.pid) if proc is not None else None
            run = load(url, c, cfg.duration_s)
            if proc is not None and cpu0 is not None and run.requests:
                cpu_us = (tree_cpu_s(proc.pid) - cpu0) * 1e6 / run.requests
                run = LoadResult(**{**asdict(run), "cpu_us_per_request": cpu_us})
            result.runs.append(run)
    except TargetMissing as exc:
        result.missing = str(exc)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        result.missing = f"failed: {exc}"
    finally:
        stop(proc)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _row(r: TargetResult, by_name: dict[str, TargetResult], hi: int, lo: int) -> str:
    if r.missing is not None:
        return f"| {r.name} | missing: {r.missing} |"
    a, b = r.at(hi), r.at(lo)
    base = by_name.get(r.baseline) if r.baseline else None
    base_run = base.at(hi) if base is not None and base.missing is None else None
    ratio = "-"
    paired = cpu_ratio(r, base, hi) if base is not None and base_run is not None else None
    if paired is not None:
        ratio = f"{paired:.2f}x {r.baseline}"
    measured = [c for c in r.cpu_rounds(hi) if c is not None]
    rounds = ", ".join(format(c, ".0f") for c in measured) if len(measured) > 1 else "-"
    direct = by_name.get("direct")
    d = direct.at(lo) if direct is not None and direct.missing is None else None
    added = b.p50_ms - d.p50_ms if b and d and r is not direct else None
    cells = [
        r.name,
        _fmt(a.rps if a else None, ",.0f"),
        _fmt(a.p50_ms if a else None, ".2f"),
        _fmt(a.p99_ms if a else None, ".2f"),
        _fmt(a.cpu_us_per_request if a else None, ".0f"),
        rounds,
        ratio,
        *_smg_ratio(r, by_name, hi),
        _fmt(b.p50_ms if b else None, ".3f"),
        _fmt(b.p99_ms if b else None, ".3f"),
        _fmt(added, "+.3f"),
        str(sum(x.errors for x in r.runs)),
    ]
    return "| " + " | ".join(cells) + " |"


def _smg_ran(by_name: dict[str, TargetResult]) -> bool:
    smg = by_name.get(SMG_BASELINE)
    return smg is not None and smg.missing is None and bool(smg.runs)


def _smg_ratio(r: TargetResult, by_name: dict[str, TargetResult], hi: int) -> list[str]:
    """The CPU ratio against smg cache_aware (same-round pairs), as a cell when smg ran."""
    if not _smg_ran(by_name):
        return []
    if r.name == SMG_BASELINE:
        return ["1.00x"]
    paired = cpu_ratio(r, by_name[SMG_BASELINE], hi)
    return [_fmt(paired, ".2f") + ("x" if paired is not None else "")]


def report(results: Sequence[TargetResult], cfg: BenchConfig, backend_name: str) -> str:
    by_name = {r.name: r for r in results}
    hi, lo = max(cfg.concurrencies), min(cfg.concurrencies)
    smg_col = " CPU vs smg cache_aware |" if _smg_ran(by_name) else ""
    lines = [
        f"kvgate bench overhead  git {git_sha()}  seed {cfg.seed}  load: {cfg.load_tool}",
        f"backend: {backend_name}",
        f"{cfg.duration_s:g}s per concurrency after {cfg.warmup_s:g}s warm-up, {cfg.repeats} round(s), "
        "medians; CPU = router process tree; CPU ratio = median over rounds of the same-round ratio",
        "",
        f"| target | c={hi} req/s | p50 ms | p99 ms | CPU µs/req | per round | CPU ratio |{smg_col} "
        f"c={lo} p50 ms | p99 ms | added p50 ms vs direct | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if smg_col else ""),
    ]
    lines += [_row(r, by_name, hi, lo) for r in results]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=int, default=5, help="seconds per measured run (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up seconds per target (default 1)")
    parser.add_argument("--concurrency", default="32,1", help="comma-separated concurrencies (default 32,1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request bodies (default 0)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all targets; medians (default 1)")
    parser.add_argument(
        "--backend",
        choices=("auto", "nginx", "builtin"),
        default="auto",
        help="static backend (default auto: nginx when installed)",
    )
    parser.add_argument(
        "--load-tool",
        choices=("auto", "wrk", "builtin"),
        default="auto",
        help="load generator (default auto: wrk when installed)",
    )
    parser.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma-separated among {', '.join(TARGET_CHOICES)} (default: all but the last)",
    )
    parser.add_argument(
        "--upstream-clients",
        action="store_true",
        help="also measure pass-through proxies with aiohttp and httpx",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="streamed chat (the backend answers an event stream; without the pass-through proxies)",
    )
    parser.add_argument(
        "--processes",
        default="1",
        help="comma-separated gateway process counts for the kvgate targets (`kvgate serve --processes`)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    names = tuple(n.strip() for n in args.targets.split(",") if n.strip())
    unknown = [n for n in names if n not in TARGET_CHOICES]
    if unknown:
        print(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGET_CHOICES)}", file=sys.stderr)
        return 2
    try:
        concurrencies = tuple(int(c) for c in args.concurrency.split(","))
        processes = tuple(int(n) for n in args.processes.split(","))
    except ValueError:
        print("--concurrency and --processes must be comma-separated integers", file=sys.stderr)
        return 2
    if not processes or min(processes) < 1 or max(processes) > 64:
        print("--processes values must be in 1..64", file=sys.stderr)
        return 2
    if not concurrencies or min(concurrencies) < 1 or max(concurrencies) > 1024:
        print("--concurrency values must be in 1..1024", file=sys.stderr)
        return 2
    if not 0 < args.duration <= 120 or not 0 <= args.warmup <= 60 or not 1 <= args.repeats <= 10:
        print("--duration must be in 1..120, --warmup in 0..60 and --repeats in 1..10", file=sys.stderr)
        return 2
    backend = args.backend
    if backend == "auto":
        backend = "nginx" if shutil.which("nginx") else "builtin"
    load_tool = args.load_tool
    if load_tool == "auto":
        load_tool = "wrk" if shutil.which("wrk") else "builtin"
    for tool, kind in ((backend, "nginx"), (load_tool, "wrk")):
        if tool == kind and not shutil.which(kind):
            print(
                f"{kind} is not installed (apt-get install -y {'nginx-light' if kind == 'nginx' else 'wrk'})"
            )
            return 2
    if args.stream and args.upstream_clients:
        print("--upstream-clients measures non-streamed pass-through proxies only", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        args.duration,
        args.warmup,
        concurrencies,
        args.seed,
        backend,
        load_tool,
        args.upstream_clients,
        names,
        args.repeats,
        args.stream,
    )
    bodies = chat_bodies(args.seed, stream=args.stream)
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-overhead-") as tmp:
        workdir = Path(tmp)
        script = workdir / "post_chat.lua"
        script.write_text(wrk_script(bodies))

        def load(url: str, c: int, dur: float) -> LoadResult:
            if load_tool == "wrk":
                return run_wrk(url, script, c, dur)
            return asyncio.run(builtin_load(url, bodies, c, dur))

        backend_proc, backend_url, backend_name = _backend(backend, workdir, args.stream)
        targets = build_targets(names, args.upstream_clients, processes)
        results = [TargetResult(t.name, t.baseline) for t in targets]
        try:
            # Rounds interleave the targets, so slow drifts of a shared machine hit all of them.
            for round_index in range(cfg.repeats):
                for target, result in zip(targets, results, strict=True):
                    if result.missing is None:
                        print(f"round {round_index + 1}: {target.name} ...", file=sys.stderr, flush=True)
                        measure(target, backend_url, cfg, workdir, load, result)
        finally:
            stop(backend_proc)
    print(report(results, cfg, backend_name))
    if args.json is not None:
        payload = {
            "git_sha": git_sha(),
            "config": asdict(cfg),
            "backend": backend_name,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0
