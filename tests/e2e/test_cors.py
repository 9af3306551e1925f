"""On real processes: browsers' cross-origin calls (the config's `cors` block). With CORS on, a
preflight of a served route is answered by the gateway itself (no key, no worker), and every answer
to an allowed origin carries the headers: a whole answer, a stream, the fast path's 401 and the
fallback's 404. With it off (the default), nothing changes: a preflight is the 405 it always was."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_config import tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start_emulator, start_gateway
from tests.support.wait import wait_until_sync

APP = "https://app.example"
KEY = {"authorization": "Bearer sk-t"}
CHAT = {"model": "emulated-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PREFLIGHT = {
    "origin": APP,
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}


@dataclass
class Gateways:
    on: str
    on_metrics: str
    off: str


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    folder: Path = tmp_path_factory.mktemp("cors")
    procs: list[Proc] = []
    try:
        worker, emulator = start_emulator()
        procs.append(emulator)
        pools = [{"name": "p", "models": ["emulated-llama"], "workers": [worker]}]
        tenants = [tenant("t", "sk-t")]
        cors = {"allow_origins": [APP, "http://localhost:3000"], "allow_credentials": True}
        on = write_gateway_config(folder / "on.yaml", pools, tenants, cors=cors)
        off = write_gateway_config(folder / "off.yaml", pools, tenants)
        on_port, on_metrics, off_port = free_port(), free_port(), free_port()
        procs.append(start_gateway(on, on_port, on_metrics))
        procs.append(start_gateway(off, off_port))
        yield Gateways(
            f"http://127.0.0.1:{on_port}",
            f"http://127.0.0.1:{on_metrics}/metrics",
            f"http://127.0.0.1:{off_port}",
        )
    finally:
        for proc in reversed(procs):
            proc.stop()


def _allowed(resp: httpx.Response) -> None:
    """The headers an answer to `APP` carries."""
    assert resp.headers["access-control-allow-origin"] == APP
    assert resp.headers["access-control-allow-credentials"] == "true"
    exposed = resp.headers["access-control-expose-headers"].split(", ")
    assert exposed[:3] == ["x-request-id", "retry-after", "retry-after-ms"]
    assert "x-ratelimit-remaining-tokens" in exposed
    assert "origin" in resp.headers.get_list("vary")


def _requests_counted(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=5).text
    return sum(
        float(v) for v in re.findall(r"^kvgate_(?:worker_)?requests_total\{[^}]*\} (\S+)$", text, re.M)
    )


def test_a_preflight_is_answered_without_a_key_or_a_worker(gateways: Gateways) -> None:
    before = _requests_counted(gateways.on_metrics)
    assert (
        httpx.post(gateways.on + "/v1/chat/completions", json=CHAT, headers=KEY, timeout=20).status_code
        == 200
    )
    wait_until_sync(lambda: _requests_counted(gateways.on_metrics) > before, what="the chat was counted")
    before = _requests_counted(gateways.on_metrics)
    resp = httpx.options(gateways.on + "/v1/chat/completions", headers=PREFLIGHT, timeout=10)
    assert resp.status_code == 204 and resp.content == b""
    assert resp.headers["access-control-allow-origin"] == APP
    assert resp.headers["access-control-allow-credentials"] == "true"
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert resp.headers["access-control-allow-headers"] == "authorization, content-type"
    assert resp.headers["access-control-max-age"] == "600"
    assert "origin" in resp.headers.get_list("vary")
    # Every served route, the fallback's GETs included.
    for path in ("/v1/models", "/v1/responses/resp_1", "/v1/embeddings"):
        asked = {**PREFLIGHT, "access-control-request-method": "GET"}
        assert httpx.options(gateways.on + path, headers=asked, timeout=10).status_code == 204
    assert _requests_counted(gateways.on_metrics) == before


def test_a_preflight_from_another_origin_is_refused(gateways: Gateways) -> None:
    resp = httpx.options(
        gateways.on + "/v1/chat/completions",
        headers={**PREFLIGHT, "origin": "https://evil.example"},
        timeout=10,
    )
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "cors_not_allowed"
    assert "access-control-allow-origin" not in resp.headers


def test_answers_to_an_allowed_origin_carry_the_headers(gateways: Gateways) -> None:
    origin = {"origin": APP}
    chat = httpx.post(gateways.on + "/v1/chat/completions", json=CHAT, headers={**KEY, **origin}, timeout=20)
    assert chat.status_code == 200 and chat.json()["choices"]
    _allowed(chat)
    with httpx.stream(
        "POST",
        gateways.on + "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={**KEY, **origin},
        timeout=20,
    ) as streamed:
        assert streamed.status_code == 200
        _allowed(streamed)
        assert b"data: [DONE]" in b"".join(streamed.iter_bytes())
    no_key = httpx.post(gateways.on + "/v1/chat/completions", json=CHAT, headers=origin, timeout=10)
    assert no_key.status_code == 401
    _allowed(no_key)
    unknown = httpx.get(gateways.on + "/v1/nothing-here", headers=origin, timeout=10)
    assert unknown.status_code == 404
    _allowed(unknown)
    models = httpx.get(gateways.on + "/v1/models", headers={**KEY, **origin}, timeout=10)
    assert models.status_code == 200
    _allowed(models)


def test_other_origins_and_same_origin_requests_get_no_cors_headers(gateways: Gateways) -> None:
    for headers in ({**KEY, "origin": "https://evil.example"}, KEY):
        resp = httpx.post(gateways.on + "/v1/chat/completions", json=CHAT, headers=headers, timeout=20)
        assert resp.status_code == 200
        assert not [name for name in resp.headers if name.startswith("access-control-")]


def test_with_cors_off_nothing_changes(gateways: Gateways) -> None:
    preflight = httpx.options(gateways.off + "/v1/chat/completions", headers=PREFLIGHT, timeout=10)
    assert preflight.status_code == 405
    chat = httpx.post(
        gateways.off + "/v1/chat/completions", json=CHAT, headers={**KEY, "origin": APP}, timeout=20
    )
    assert chat.status_code == 200
    for resp in (preflight, chat):
        assert not [name for name in resp.headers if name.startswith("access-control-")]
