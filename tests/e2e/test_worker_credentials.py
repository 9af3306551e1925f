"""Workers that want an API key, on real processes: an emulated vLLM worker started with
`--api-key` (the key from an environment variable), a fake worker whose key comes from a file,
the OpenAI SDK through the gateway, and the keys nowhere in the gateway's output."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from gateway.auth import hash_api_key
from tests.e2e.harness import SECRET, Proc, free_port, start, tenant, wait_http, write_gateway_config
from tests.e2e.test_openai_sdk import worker_log

EMU_KEY = "sk-emulated-worker-5d1c"
FILE_KEY = "sk-fake-worker-9b2e"
ADMIN_KEY = "sk-admin-e2e"


@dataclass
class KeyedStack:
    base_url: str
    emulator_url: str
    fake_url: str
    gateway: Proc


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedStack]:
    folder = tmp_path_factory.mktemp("gw-keys")
    emu_port, fake_port, port = free_port(), free_port(), free_port()
    emulator_url, fake_url = f"http://127.0.0.1:{emu_port}", f"http://127.0.0.1:{fake_port}"
    procs: list[Proc] = []
    try:
        argv = [sys.executable, "-m", "loadtest.emulator", "--port", str(emu_port), "--model", "m-emu"]
        procs.append(start([*argv, "--api-key", EMU_KEY]))
        procs.append(start([sys.executable, "-m", "tests.e2e.fake_worker", "--listen", f"{fake_port}:ok"]))
        wait_http(emulator_url + "/health", procs[0])
        wait_http(fake_url + "/health", procs[1])
        (folder / "fake-key").write_text(FILE_KEY + "\n")  # as a mounted Secret: a file, a newline
        fast = {"health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3}}
        pools = [
            {
                "name": "emu",
                "models": ["m-emu"],
                "workers": [emulator_url],
                "worker_api_key_env": "EMU_KEY",
                **fast,
            },
            {
                "name": "fake",
                "models": ["m-fake"],
                "workers": [fake_url],
                "worker_api_key_file": "fake-key",  # relative: beside the config file
                "forward_headers": ["X-Trace-Tag"],
                **fast,
            },
        ]
        config = write_gateway_config(
            folder / "gateway.yaml",
            pools,
            [tenant("acme", "sk-acme")],
            scrape={"interval_s": 0.2},
            admin={"api_key_hash": hash_api_key(SECRET, ADMIN_KEY)},
        )
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)]
        gateway = start(
            [*argv, "--metrics-port", "0"], env={"KVGATE_KEY_SECRET": SECRET.decode(), "EMU_KEY": EMU_KEY}
        )
        procs.append(gateway)
        wait_http(f"http://127.0.0.1:{port}/readyz", gateway)
        yield KeyedStack(f"http://127.0.0.1:{port}", emulator_url, fake_url, gateway)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _client(stack: KeyedStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-acme", max_retries=0, timeout=20)


def test_the_emulated_worker_wants_its_key_and_the_gateway_sends_it(keyed: KeyedStack) -> None:
    body = {"model": "m-emu", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    direct = httpx.post(keyed.emulator_url + "/v1/chat/completions", json=body, timeout=10)
    assert direct.status_code == 401 and direct.json() == {"error": "Unauthorized"}
    assert httpx.get(keyed.emulator_url + "/health", timeout=5).status_code == 200  # as vLLM: open
    for stream in (False, True):
        reply = _client(keyed).chat.completions.create(
            model="m-emu", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=stream
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)  # type: ignore[union-attr]
        else:
            text = reply.choices[0].message.content or ""  # type: ignore[union-attr]
        assert text


def test_a_key_from_a_file_goes_with_completions_health_checks_and_scrapes(keyed: KeyedStack) -> None:
    _client(keyed).chat.completions.create(
        model="m-fake",
        messages=[{"role": "user", "content": "x"}],
        user="keyed",
        extra_headers={"X-Trace-Tag": "run-7", "x-other": "private"},
    )
    (record,) = [r for r in worker_log(keyed.fake_url)["requests"] if r["body"].get("user") == "keyed"]
    assert record["headers"]["authorization"] == f"Bearer {FILE_KEY}"
    assert record["headers"]["x-trace-tag"] == "run-7" and "x-other" not in record["headers"]
    deadline = time.monotonic() + 10
    while True:
        # The gateway's requests (the test harness probed the worker's health before it started).
        others = [o for o in worker_log(keyed.fake_url)["others"] if "urllib" not in o["user_agent"]]
        paths = {o["path"] for o in others}
        if {"/health", "/metrics"} <= paths or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {"/health", "/metrics"} <= paths
    assert {o["authorization"] for o in others} == {f"Bearer {FILE_KEY}"}


def test_the_keys_are_neither_logged_nor_shown(keyed: KeyedStack) -> None:
    status = httpx.get(
        keyed.base_url + "/admin/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    )
    assert status.status_code == 200 and "emu" in status.text
    for key in (EMU_KEY, FILE_KEY):
        assert key not in status.text
        assert key not in keyed.gateway.output()


def test_a_missing_key_stops_the_start_with_a_clear_message(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("gw-nokey")
    pools = [
        {"name": "emu", "models": ["m"], "workers": ["http://127.0.0.1:9"], "worker_api_key_env": "NOPE_KEY"}
    ]
    config = write_gateway_config(folder / "gateway.yaml", pools, [tenant("acme", "sk-acme")])
    proc = start(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(free_port())],
        env={"KVGATE_KEY_SECRET": SECRET.decode()},
    )
    try:
        assert proc.popen.wait(30) == 2
    finally:
        proc.stop()
    assert "pools.emu.worker_api_key_env: environment variable NOPE_KEY is not set" in proc.output()
