"""`kvgate serve --config --processes 2`: a process the supervisor restarts starts from what the
group runs. The config is the one the group started with, however the file was edited since, and
a workers or policy file that is invalid at that moment is taken at its last valid version, as the
running processes keep it; the restart neither fails nor takes the healthy process down with it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from tests.e2e.harness import (
    SECRET,
    Proc,
    gateway_processes,
    metrics_urls,
    serving_processes,
    start_emulator,
    tenant,
    write_gateway_config,
)
from tests.support.wait import wait_until_sync

KEY = "sk-e2e-restart-files-0123456789abcdef"


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _ask(base: str) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    # A fresh client is a fresh connection: the kernel picks the process.
    with httpx.Client(timeout=30) as client:
        resp = client.post(
            base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
    return resp.status_code


def test_a_restarted_process_starts_from_what_the_group_runs(tmp_path: Path) -> None:
    worker, emulator = start_emulator("--model", "m", "--time-scale", "50")
    try:
        workers, policy = tmp_path / "workers.yaml", tmp_path / "policy.yaml"
        _write(workers, f"- {worker}\n")
        _write(policy, "policy: round_robin\n")
        pool = {"name": "p", "models": ["m"], "workers_file": {"path": "workers.yaml", "refresh_s": 0.5}}
        config = write_gateway_config(
            tmp_path / "gw.yaml",
            [pool],
            [tenant("t", KEY)],
            policy_file="policy.yaml",
            policy_reload_interval_s=0.5,
            drain={"shutdown_delay_s": 0, "deadline_s": 2},
        )
        env = {"KVGATE_KEY_SECRET": SECRET.decode()}
        with serving_processes("--config", str(config), env=env) as (base, proc):
            _break_everything_and_kill_one(config, workers, policy, proc)
            listening = len(metrics_urls(proc))

            def restarted_listens() -> bool:
                assert proc.popen.poll() is None, proc.output()[-3000:]
                return len(metrics_urls(proc)) > listening

            # (Before, the restarted process exited 2 on the broken files again and again, and
            # the supervisor gave up after 5 restarts, stopping the healthy process too.)
            wait_until_sync(restarted_listens, 60, "the restarted process listens")
            assert len(gateway_processes(proc.popen.pid)) == 2
            # The old key over fresh connections: both processes still know it (the chance that
            # the kernel hands all 20 to the same process is about 2e-6).
            assert [_ask(base) for _ in range(20)] == [200] * 20
            out = proc.output()
            assert "workers_file: " in out and "policy_file: " in out
            assert "starts on its last valid version" in out
            assert proc.stop() == 0
    finally:
        emulator.stop()


def _break_everything_and_kill_one(config: Path, workers: Path, policy: Path, proc: Proc) -> None:
    # The config now names another key only; the workers and policy files are invalid.
    other = tenant("t", "sk-e2e-another-key-0123456789abcdef")["api_key_hashes"][0]
    text = config.read_text()
    _write(config, text.replace(tenant("t", KEY)["api_key_hashes"][0], other))
    _write(workers, "- [oops\n")
    _write(policy, "policy: nosuch\n")
    pids = gateway_processes(proc.popen.pid)
    assert len(pids) == 2
    os.kill(min(pids), signal.SIGKILL)
    wait_until_sync(lambda: "restarting" in proc.output(), 30, "the supervisor restarts it")
