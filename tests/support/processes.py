"""Real processes on 127.0.0.1: each starts in its own process group with its output in a file,
is waited for until it answers, and is always stopped by its PID (the whole group, so a gateway's
or an emulator's children go with it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.ports import free_port as free_port
from tests.support.gateway_config import SECRET, tenant, write_gateway_config
from tests.support.wait import wait_until_sync

REPO = Path(__file__).resolve().parents[2]

# `free_port` (re-exported for the tests): a port is often bound by its process only later (a worker's second
# listener, a config written before the gateway starts), and the kernel readily hands a
# just-closed port out again, so `loadtest.ports` never gives the same one twice.


@dataclass
class Proc:
    """A started process and its combined output file."""

    popen: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        """Send `sig` to the process group, SIGKILL it after `timeout_s`; the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode


def start(argv: Sequence[str], env: dict[str, str] | None = None, log_path: Path | None = None) -> Proc:
    """Start `argv` from the repository root, output to `log_path` (a temporary file if None)."""
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="kvgate-test-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(
            list(argv),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return Proc(popen, log_path)


def wait_http(url: str, proc: Proc, timeout_s: float = 30.0, status: int = 200) -> None:
    """Wait until GET `url` answers `status`; fail at once, with the output, if `proc` exits."""

    def answers() -> bool:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"process exited with {proc.popen.returncode}:\n{proc.output()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return bool(resp.status == status)
        except (urllib.error.URLError, OSError):
            return False

    try:
        wait_until_sync(answers, timeout_s, what=f"{url} answers {status}")
    except AssertionError as exc:
        raise RuntimeError(f"{exc}\n{proc.output()[-3000:]}") from None


def started(
    argv: Sequence[str], ready_url: str, env: dict[str, str] | None = None, timeout_s: float = 30.0
) -> Proc:
    """`start`, then `wait_http(ready_url)`; the process is stopped if it never gets ready."""
    proc = start(argv, env)
    try:
        wait_http(ready_url, proc, timeout_s)
    except BaseException:
        proc.stop()
        raise
    return proc


# ---------------------------------------------------------------- the emulated vLLM worker


def start_emulator(*args: str, port: int | None = None) -> tuple[str, Proc]:
    """`python -m loadtest.emulator` on `port` (a free one if None), healthy; its base URL and
    process (the caller stops it)."""
    port = free_port() if port is None else port
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "loadtest.emulator", "--port", str(port), *args]
    return base, started(argv, base + "/health")


@contextlib.contextmanager
def running_emulator(*args: str, port: int | None = None) -> Iterator[str]:
    """`start_emulator` for the duration of a `with` block; yields the base URL."""
    base, proc = start_emulator(*args, port=port)
    try:
        yield base
    finally:
        proc.stop()


# ---------------------------------------------------------------- a gateway


def start_gateway(
    config_path: Path,
    port: int,
    metrics_port: int = 0,
    secret: bytes = SECRET,
    port_from_config: bool = False,
    env: dict[str, str] | None = None,
) -> Proc:
    """`kvgate serve --config` on `port`, ready (its /readyz answers 200); the caller stops it.
    `env` adds to its environment (the key secret is set from `secret`).
    Its /metrics listens on `metrics_port` (0: any free port, for tests that do not read metrics;
    never the fixed default, which gateways started side by side would share). With
    `port_from_config` the config's own `listen` and `metrics.listen` are used, and must name `port`."""
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)]
    if not port_from_config:
        # Any free port, from this test process's share (`loadtest.ports`): a port the kernel
        # picks for port 0 could be one another parallel test process has just picked.
        metrics_port = metrics_port or free_port()
        argv += ["--port", str(port), "--metrics-port", str(metrics_port)]
    return started(
        argv, f"http://127.0.0.1:{port}/readyz", {"KVGATE_KEY_SECRET": secret.decode(), **(env or {})}
    )


@dataclass
class LoneGateway:
    """A gateway process whose one worker never answers (a free port): every request is answered
    or refused by the gateway itself, as the tests of its own framing and closes want."""

    port: int
    proc: Proc


@contextlib.contextmanager
def lone_gateway(folder: Path, limits: dict[str, object]) -> Iterator[LoneGateway]:
    """A `LoneGateway` with `limits`, tenant `a` (key `sk-a`), policy `cost`; stopped on exit."""
    (folder / "policy.yaml").write_text("policy: cost\n")
    config = write_gateway_config(
        folder / "gateway.yaml",
        [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{free_port()}"]}],
        [tenant("a", "sk-a")],
        limits=limits,
        policy_file="policy.yaml",
    )
    port = free_port()
    proc = start_gateway(config, port)
    try:
        yield LoneGateway(port, proc)
    finally:
        proc.stop()
