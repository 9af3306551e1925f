"""Prefill/decode failures between real emulator processes: a transfer that times out, a room no
prefill ever joins, a decode worker that never registers, held KV that expires unread, and a
prefill worker that is gone. Under `--kv-load-failure-policy fail` the decode worker answers as
vLLM does (500, or a stream carrying the error); under `recompute` it prefills the prompt itself."""

from __future__ import annotations

import random
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.loadtest.test_emulator import MODEL, metric, running_emulator
from tests.loadtest.test_emulator_pd import chat, messages, prefill_leg, stream_chat
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e

COMMON = ("--time-scale", "20", "--kv-blocks", "4000")


def slow_link_profile(directory: Path) -> str:
    """The default profile with a 1 MB/s link: a 600-token prompt takes minutes to move."""
    text = resources.files("loadtest.profiles").joinpath("llama3-8b-h100.yaml").read_text()
    lines = [
        "kv_transfer_bytes_per_s: 1.0e6" if line.startswith("kv_transfer_bytes_per_s") else line
        for line in text.splitlines()
    ]
    path = directory / "slow-link.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    slow = slow_link_profile(tmp_path_factory.mktemp("profiles"))
    with (
        running_emulator(*COMMON, "--role", "prefill", "--kv-bootstrap-timeout-s", "1") as p,
        running_emulator(
            *COMMON, "--role", "decode", "--profile", slow, "--kv-transfer-timeout-s", "1"
        ) as fail,
        running_emulator(
            *COMMON,
            "--role",
            "decode",
            "--kv-transfer-timeout-s",
            "1",
            "--kv-load-failure-policy",
            "recompute",
        ) as recompute,
    ):
        yield {"prefill": p, "fail": fail, "recompute": recompute}


def failed(base: str) -> float:
    return metric(base, "vllm:nixl_num_failed_transfers")


def bootstrap_body(prefill_base: str, tag: str, room: int | None = None) -> dict[str, Any]:
    port = int(prefill_base.rsplit(":", 1)[1])
    room = random.getrandbits(63) if room is None else room
    return {"messages": messages(tag), "max_tokens": 4, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": room}  # fmt: skip


def test_a_transfer_longer_than_the_timeout_fails_as_vllm_does(workers: dict[str, str]) -> None:
    p, d = workers["prefill"], workers["fail"]
    before, arrived = failed(d), metric(d, "vllm:nixl_xfer_time_seconds_count")
    params = prefill_leg(p, messages("F"))["kv_transfer_params"]
    resp = chat(d, {"messages": messages("F"), "max_tokens": 4, "kv_transfer_params": params})
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "Internal server error"
    assert resp.json()["error"]["type"] == "InternalServerError"
    assert failed(d) == before + 1
    assert metric(d, "vllm:nixl_xfer_time_seconds_count") == arrived  # nothing arrived


def test_a_failed_transfer_on_a_stream_opens_it_then_sends_the_error(workers: dict[str, str]) -> None:
    p, d = workers["prefill"], workers["fail"]
    params = prefill_leg(p, messages("G"))["kv_transfer_params"]
    body = {"model": MODEL, "messages": messages("G"), "max_tokens": 4, "stream": True,
            "kv_transfer_params": params}  # fmt: skip
    with httpx.stream("POST", f"{d}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"InternalServerError"' in lines[0] and len(lines) == 2


def test_a_room_no_prefill_joins_times_out_on_the_decode_worker(workers: dict[str, str]) -> None:
    d = workers["fail"]
    resp = chat(d, bootstrap_body(workers["prefill"], "H"))  # the prefill leg never goes out
    assert resp.status_code == 500
    message = resp.json()["error"]["message"]
    assert message.startswith("KV transfer failed") and "did not finish within 1 s" in message


def test_recompute_policy_prefills_locally(workers: dict[str, str]) -> None:
    d = workers["recompute"]
    before = failed(d)
    text, usage = stream_chat(d, bootstrap_body(workers["prefill"], "I"))
    assert len(text) == 4 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert failed(d) == before + 1


def test_a_prefill_leg_whose_decode_worker_never_registers_fails(workers: dict[str, str]) -> None:
    resp = chat(workers["prefill"], bootstrap_body(workers["prefill"], "J"))
    assert resp.status_code == 500
    assert resp.json()["error"]["message"].startswith("Prefill bootstrap failed for request bootstrap_room=")


def test_held_kv_expires_unread_and_then_cannot_be_pulled(workers: dict[str, str]) -> None:
    with running_emulator(*COMMON, "--role", "prefill", "--kv-hold-timeout-s", "0.3") as p:
        params = prefill_leg(p, messages("K"))["kv_transfer_params"]
        wait_until_sync(lambda: metric(p, "vllm:nixl_num_kv_expired_reqs") == 1, what="the held KV expired")
        assert metric(p, "vllm:kv_cache_usage_perc") == 0  # the held blocks were released
        text, usage = stream_chat(
            workers["recompute"], {"messages": messages("K"), "max_tokens": 3, "kv_transfer_params": params}
        )
    assert len(text) == 3 and usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_prefill_worker_that_is_gone(workers: dict[str, str]) -> None:
    with running_emulator(*COMMON, "--role", "prefill") as p:
        params = prefill_leg(p, messages("L"))["kv_transfer_params"]
        sglang = bootstrap_body(p, "L")
    # The process is stopped: its address refuses connections.
    resp = chat(workers["fail"], {"messages": messages("L"), "max_tokens": 4, "kv_transfer_params": params})
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "Internal server error"
    dead_room = chat(workers["fail"], sglang)
    assert dead_room.status_code == 500 and "it might be dead" in dead_room.json()["error"]["message"]
    text, usage = stream_chat(
        workers["recompute"], {"messages": messages("L"), "max_tokens": 4, "kv_transfer_params": params}
    )
    assert len(text) == 4 and usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_an_sglang_decode_server_refuses_a_request_not_paired() -> None:
    # SGLang's decode server admits only KV a prefill server computed; a vLLM decode server (the
    # default, `--pd-protocol any`) runs a plain request whole.
    body = {"messages": messages("s"), "max_tokens": 4}
    with running_emulator(*COMMON, "--role", "decode", "--pd-protocol", "sglang") as sglang:
        refused = chat(sglang, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "bootstrap_room"
    with running_emulator(*COMMON, "--role", "decode") as vllm:
        assert chat(vllm, body).status_code == 200
