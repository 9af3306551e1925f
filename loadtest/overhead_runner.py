"""Running the targets of `kvgate bench overhead`: one target's measured runs, what each run cost in
CPU (the router's process tree, the backend's, the load generator's and the whole machine's), and
the same-round CPU ratio.

On a small shared machine the router does not get the cores to itself: wrk (or the built-in load
generator) and the backend run beside it, and other jobs too. Each run therefore records how many
cores every party used over the run, so a throughput ratio can be read against the CPU the
gateway actually got.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest.overhead_load import CLK_TCK, LoadResult, stop, tree_cpu_by_process, tree_cpu_s
from loadtest.overhead_targets import Target, TargetMissing


@dataclass(frozen=True, slots=True)
class CpuShare:
    """Cores used during one run (CPU seconds / wall seconds): the router's tree, each of its
    processes by name, the backend's tree, the load generator, and every process of the machine."""

    router: float
    router_processes: tuple[tuple[str, float], ...]
    backend: float
    load_generator: float
    machine: float
    wall_s: float

    @property
    def others(self) -> float:
        """Cores used by everything else on the machine (other jobs, the kernel's own threads)."""
        return max(0.0, self.machine - self.router - self.backend - self.load_generator)


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


def own_cpu_s() -> float:
    """This process's CPU and that of its reaped children (wrk, once its run has returned)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass(slots=True)
class TargetResult:
    """A target's runs, or why it could not run."""

    name: str
    baseline: str | None
    runs: list[LoadResult] = field(default_factory=list)
    missing: str | None = None
    cpu: list[CpuShare | None] = field(default_factory=list)  # one per run, in step with `runs`

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

    def shares(self, concurrency: int) -> list[CpuShare]:
        """The CPU shares of the runs at `concurrency` that recorded one, in round order."""
        pairs = zip(self.runs, self.cpu, strict=False)
        return [s for r, s in pairs if r.concurrency == concurrency and s is not None]


def cpu_ratio(target: TargetResult, baseline: TargetResult, concurrency: int) -> float | None:
    """The median over rounds of target CPU / baseline CPU in the same round. Rounds interleave the
    targets, so a round's pair saw the same machine load; CPU per request of a multi-threaded
    router moves with that load (fewer idle wake-ups per request on a busy machine)."""
    pairs = zip(target.cpu_rounds(concurrency), baseline.cpu_rounds(concurrency), strict=False)
    ratios = [a / b for a, b in pairs if a is not None and b]
    return statistics.median(ratios) if ratios else None


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


def measure(
    target: Target,
    backend: tuple[str, int | None],
    cfg: BenchConfig,
    workdir: Path,
    load: Callable[[str, int, float], LoadResult],
    result: TargetResult,
) -> None:
    """Start the target in front of the backend (URL, PID), warm it up, run every concurrency, stop
    it; runs and their CPU shares are appended to `result`."""
    backend_url, backend_pid = backend
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, url = target.start(backend_url, workdir)
        if cfg.warmup_s > 0:
            load(url, max(cfg.concurrencies), cfg.warmup_s)
        for c in cfg.concurrencies:
            before = _snapshot(proc, backend_pid)
            run = load(url, c, cfg.duration_s)
            share = _share(before, _snapshot(proc, backend_pid))
            if proc is not None and run.requests:
                cpu_us = share.router * share.wall_s * 1e6 / run.requests
                run = LoadResult(**{**asdict(run), "cpu_us_per_request": cpu_us})
            result.runs.append(run)
            result.cpu.append(share)
    except TargetMissing as exc:
        result.missing = str(exc)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        result.missing = f"failed: {exc}"
    finally:
        stop(proc)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    wall: float
    router: dict[int, tuple[str, float]]
    backend: float
    own: float
    machine: float


def _snapshot(proc: subprocess.Popen[bytes] | None, backend_pid: int | None) -> _Snapshot:
    return _Snapshot(
        time.monotonic(),
        tree_cpu_by_process(proc.pid) if proc is not None else {},
        tree_cpu_s(backend_pid) if backend_pid is not None else 0.0,
        own_cpu_s(),
        machine_busy_s(),
    )


def _share(a: _Snapshot, b: _Snapshot) -> CpuShare:
    """Cores used between two snapshots. A router process is counted when it was there at both
    (a `--processes` child restarted mid-run would be missed, and so would its CPU)."""
    wall = max(b.wall - a.wall, 1e-9)
    per_process = sorted(
        ((name, (cpu - a.router[pid][1]) / wall) for pid, (name, cpu) in b.router.items() if pid in a.router),
        key=lambda item: -item[1],
    )
    return CpuShare(
        router=sum(cores for _, cores in per_process),
        router_processes=tuple((name, round(cores, 3)) for name, cores in per_process),
        backend=(b.backend - a.backend) / wall,
        load_generator=(b.own - a.own) / wall,
        machine=(b.machine - a.machine) / wall,
        wall_s=wall,
    )
