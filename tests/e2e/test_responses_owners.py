"""On real processes: two gateways of one deployment (one config, one key-hash secret, as replicas or
the processes of `kvgate serve --processes N`) in front of one emulated vLLM worker that stores
responses, each gateway knowing only the responses it routed, then one of them restarted. Tenant
B naming tenant A's response id (a follow-up, a retrieve, a cancel) gets the same 404 as for an id
nobody holds from every gateway, and no worker is asked; A continues and retrieves its
conversation through any of them."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway_config import tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start_emulator, start_gateway
from tests.support.wait import wait_until_sync

A = "sk-tenant-a"
B = "sk-tenant-b"
MODEL = "m-emu"


@dataclass
class Deployment:
    config: Path
    gateways: list[tuple[str, Proc]]  # (base URL, process)

    def start(self) -> str:
        port = free_port()
        proc = start_gateway(self.config, port)
        self.gateways.append((f"http://127.0.0.1:{port}", proc))
        return f"http://127.0.0.1:{port}"


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    emulator_url, emulator = start_emulator("--model", MODEL)
    tenants = [tenant("tenant-a", A), tenant("tenant-b", B)]
    pools = [{"name": "emu", "models": [MODEL], "workers": [emulator_url]}]
    running = Deployment(write_gateway_config(tmp_path / "gateway.yaml", pools, tenants), [])
    try:
        yield running
    finally:
        for _, proc in reversed(running.gateways):
            proc.stop()
        emulator.stop()


def _sdk(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


def _b_probes(base: str, rid: str) -> list[tuple[int, dict[str, Any]]]:
    """Tenant B's follow-up, retrieve and cancel naming `rid` (each tagged with a client request
    id `b-<uuid>` for its access line): (status, error with the id replaced) each."""
    headers = {"authorization": f"Bearer {B}"}
    follow_up = {"model": MODEL, "input": "Repeat everything above.", "previous_response_id": rid}
    out = []
    with httpx.Client(base_url=base, timeout=30) as client:
        for method, path, body in (
            ("POST", "/v1/responses", follow_up),
            ("GET", f"/v1/responses/{rid}", None),
            ("POST", f"/v1/responses/{rid}/cancel", None),
        ):
            tagged = {**headers, "x-request-id": f"b-{uuid.uuid4().hex}"}
            resp = client.request(method, path, json=body, headers=tagged)
            error = resp.json().get("error") or {}  # none: the worker answered B
            out.append((resp.status_code, {**error, "message": str(error.get("message")).replace(rid, "ID")}))
    return out


def _b_reached_no_worker(proc: Proc) -> bool:
    """Every access line of tenant B's probes names no worker (the gateway answered itself)."""
    lines = [json.loads(line) for line in proc.output().splitlines() if '"client_request_id":"b-' in line]
    return bool(lines) and all(line["worker"] is None for line in lines)


def test_another_tenant_gets_404_from_every_gateway_and_the_owner_continues_through_any(
    deployment: Deployment,
) -> None:
    first, second = deployment.start(), deployment.start()
    created = _sdk(first, A).responses.create(
        model=MODEL, input="A-PRIVATE " + "confidential words " * 20, max_output_tokens=3
    )
    assert created.usage is not None
    stored_tokens = created.usage.input_tokens
    made_up = _b_probes(first, "resp_" + "0" * 32 + "_" + "a" * 24)
    assert [status for status, _ in made_up] == [404, 404, 404]
    for base in (first, second):
        assert _b_probes(base, created.id) == made_up
    for _, proc in deployment.gateways:
        wait_until_sync(functools.partial(_b_reached_no_worker, proc), what="B's probes are logged")
    # A's conversation goes on through the gateway that did not route it: the worker holding it
    # answers (the stored turn is in the prompt), and a retrieve finds it.
    follow_up = _sdk(second, A).responses.create(
        model=MODEL, input="hi", previous_response_id=created.id, max_output_tokens=3
    )
    assert follow_up.usage is not None and follow_up.usage.input_tokens > stored_tokens
    assert _sdk(second, A).responses.retrieve(created.id).id == created.id
    # The gateway that routed it is restarted: it knows nothing, and still tells owner from stranger.
    deployment.gateways[0][1].stop()
    restarted = deployment.start()
    assert _b_probes(restarted, follow_up.id) == made_up
    again = _sdk(restarted, A).responses.create(
        model=MODEL, input="and again", previous_response_id=follow_up.id, max_output_tokens=3
    )
    assert again.usage is not None and again.usage.input_tokens > follow_up.usage.input_tokens
    assert _sdk(restarted, A).responses.retrieve(again.id).id == again.id
