"""A pool whose workers are listed in a file: a real gateway follows the file as it is replaced and
as it is rewritten in place (emulated vLLM workers added and removed), and keeps its last set
through a broken version."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import openai

from tests.e2e.harness import free_port, start_emulator, start_gateway, tenant, write_gateway_config
from tests.support.processes import Proc
from tests.support.wait import wait_until_sync


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _routable(metrics_url: str) -> set[str]:
    text = httpx.get(metrics_url, timeout=5).text
    return set(re.findall(r'kvgate_worker_healthy\{pool="p",worker="([^"]+)"\} 1\.0', text))


def _file_errors(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=5).text
    found = re.search(r'kvgate_discovery_errors_total\{pool="p",reason="file"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_the_pool_follows_its_workers_file(tmp_path: Path) -> None:
    procs: list[Proc] = []
    gateway = None
    try:
        a, proc_a = start_emulator("--model", "m", "--time-scale", "50")
        b, proc_b = start_emulator("--model", "m", "--time-scale", "50")
        procs += [proc_a, proc_b]
        workers = tmp_path / "workers.yaml"
        _write(workers, f"- {a}\n")
        # refresh_s 2: a version rewritten in place settles for 1 s (the most), so the in-place
        # rewrite below is read half-done only if its two writes land more than 1 s apart.
        pool = {"name": "p", "models": ["m"], "workers_file": {"path": "workers.yaml", "refresh_s": 2.0}}
        config = write_gateway_config(tmp_path / "gw.yaml", [pool], [tenant("t", "sk-t")])
        port, metrics_port = free_port(), free_port()
        gateway = start_gateway(config, port, metrics_port)
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-t", max_retries=0, timeout=30
        )

        def ask() -> None:
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=2
            )
            assert reply.choices[0].message.content

        wait_until_sync(lambda: _routable(metrics) == {a}, what="a routable")
        ask()
        _write(workers, f"workers:\n  - {a}\n  - url: {b}\n")
        wait_until_sync(lambda: _routable(metrics) == {a, b}, what="b added and routable")
        inode = workers.stat().st_ino
        with open(workers, "w") as f:  # in place, in two writes, as a shell's `>` does
            f.write("- ")
            f.flush()
            f.write(f"{b}\n")
        assert workers.stat().st_ino == inode
        wait_until_sync(lambda: _routable(metrics) == {b}, what="a removed")
        assert _file_errors(metrics) == 0.0  # neither the emptied file nor its first piece counted
        proc_a.stop()  # nothing routes to it any more: every request is served by b alone
        for _ in range(4):
            ask()
        _write(workers, f"- {b}\n- {a}/v1/chat\n")  # invalid: the last set stays
        wait_until_sync(lambda: _file_errors(metrics) == 1.0, what="the invalid file counted")
        assert _routable(metrics) == {b}
        ask()
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs:
            proc.stop()
