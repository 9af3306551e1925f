"""A pool of emulated vLLM workers as real processes (`python -m loadtest.emulator`), fresh each time."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from loadtest.peers.launch import RunningProcess, wait_http_ready
from loadtest.ports import free_port


@dataclass(frozen=True, slots=True)
class EmulatorSettings:
    """Flags every worker of the pool gets (see `kvgate emulate --help`)."""

    model: str = "emulated-llama"
    profile: str | None = None
    kv_blocks: int | None = None
    time_scale: float = 1.0
    seed: int = 0
    max_model_len: int = 262144


def emulator_argv(port: int, settings: EmulatorSettings, index: int) -> list[str]:
    """The command line of worker `index` of a pool (its seed is the pool's plus the index)."""
    argv = [sys.executable, "-m", "loadtest.emulator", "--port", str(port), "--host", "127.0.0.1"]
    argv += ["--model", settings.model, "--time-scale", str(settings.time_scale)]
    argv += ["--seed", str(settings.seed + index), "--max-model-len", str(settings.max_model_len)]
    if settings.profile:
        argv += ["--profile", settings.profile]
    if settings.kv_blocks:
        argv += ["--kv-blocks", str(settings.kv_blocks)]
    return argv


class EmulatorPool:
    """N workers on free loopback ports; `stop()` ends every process by its PID (process group)."""

    def __init__(
        self, n: int, settings: EmulatorSettings, workdir: Path, ready_timeout_s: float = 30.0
    ) -> None:
        self.procs: list[RunningProcess] = []
        self.urls: list[str] = []
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(n):
                port = free_port()
                argv = emulator_argv(port, settings, i)
                self.procs.append(RunningProcess(argv, log_path=workdir / f"worker{i}.log"))
                self.urls.append(f"http://127.0.0.1:{port}")
            for url, proc in zip(self.urls, self.procs, strict=True):
                wait_http_ready(url + "/health", proc, ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


class PdEmulatorPool:
    """P prefill and D decode workers speaking SGLang's bootstrap protocol: each prefill worker
    also listens on a bootstrap port of its own (`bootstrap_ports`, by URL). `urls` lists the
    prefill workers first."""

    def __init__(
        self,
        n_prefill: int,
        n_decode: int,
        settings: EmulatorSettings,
        workdir: Path,
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.procs: list[RunningProcess] = []
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        self.bootstrap_ports: dict[str, int] = {}
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(n_prefill + n_decode):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                argv = emulator_argv(port, settings, i)
                if i < n_prefill:
                    boot = free_port()
                    argv += [
                        "--role",
                        "prefill",
                        "--kv-engine-id",
                        f"prefill{i}",
                        "--bootstrap-port",
                        str(boot),
                    ]
                    self.prefill_urls.append(url)
                    self.bootstrap_ports[url] = boot
                    name = f"prefill{i}"
                else:
                    # SGLang's bootstrap protocol: a decode server refuses a request not paired.
                    argv += [
                        "--role",
                        "decode",
                        "--pd-protocol",
                        "sglang",
                        "--kv-engine-id",
                        f"decode{i - n_prefill}",
                    ]
                    self.decode_urls.append(url)
                    name = f"decode{i - n_prefill}"
                self.procs.append(RunningProcess(argv, log_path=workdir / f"{name}.log"))
            for url, proc in zip(self.urls, self.procs, strict=True):
                wait_http_ready(url + "/health", proc, ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return [*self.prefill_urls, *self.decode_urls]

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()
