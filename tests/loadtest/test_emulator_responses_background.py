"""Background Responses (`"background": true`) on the emulated worker (a real process on loopback),
as vLLM's Responses serving runs them: answered at once with the object `queued`, run on without
the client, the stored object replaced when the run ends, cancellable while it runs, and a
streamed one replayed from its recorded events."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e

MODEL = "emu-background"
LONG = 30000  # output tokens: many seconds of engine time, so the run is surely still going


def _metric(base_url: str, name: str, label: str = "") -> float:
    """The value of the metric series `name` whose labels contain `label`."""
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {label} missing")


def running(base_url: str) -> float:
    return _metric(base_url, "vllm:num_requests_running")


def ran_to_limit(base_url: str) -> float:
    return _metric(base_url, "vllm:request_success_total", 'finished_reason="length"')


def _get(base_url: str, response_id: str) -> dict[str, Any]:
    resp = httpx.get(f"{base_url}/v1/responses/{response_id}", timeout=5)
    assert resp.status_code == 200
    body: dict[str, Any] = resp.json()
    return body


def _events(resp: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


def test_a_background_response_is_queued_then_stored_when_done(client: openai.OpenAI, base_url: str) -> None:
    queued = client.responses.create(
        model=MODEL, input="in the background", max_output_tokens=5, background=True
    )
    assert queued.status == "queued" and queued.background is True
    assert queued.output == [] and queued.usage is None
    done = wait_until_sync(
        lambda: (body := _get(base_url, queued.id))["status"] != "queued" and body,
        what="background run ended",
    )
    # Cut at max_output_tokens: vLLM's `incomplete`, with the output and usage of a plain response.
    assert done["status"] == "incomplete" and done["background"] is True
    assert len(done["output"][0]["content"][0]["text"]) == 5 and done["usage"]["output_tokens"] == 5
    # It continues like any stored response, and an ended one cannot be cancelled.
    follow = client.responses.create(
        model=MODEL, input="and then?", previous_response_id=queued.id, max_output_tokens=2
    )
    assert follow.usage is not None and follow.usage.input_tokens > done["usage"]["input_tokens"]
    late = httpx.post(f"{base_url}/v1/responses/{queued.id}/cancel", timeout=5)
    assert (
        late.status_code == 400 and late.json()["error"]["message"] == "Cannot cancel a synchronous response."
    )
    # A response that was not run in the background cannot be cancelled either.
    plain = client.responses.create(model=MODEL, input="now", max_output_tokens=2)
    assert plain.background is False
    assert httpx.post(f"{base_url}/v1/responses/{plain.id}/cancel", timeout=5).status_code == 400


def test_cancel_stops_a_running_background_response(client: openai.OpenAI, base_url: str) -> None:
    queued = client.responses.create(model=MODEL, input="a long one", max_output_tokens=LONG, background=True)
    wait_until_sync(lambda: running(base_url) == 1, what="background run started")
    # vLLM's stored object says `queued` until the run ends.
    assert _get(base_url, queued.id)["status"] == "queued"
    resp = httpx.post(f"{base_url}/v1/responses/{queued.id}/cancel", timeout=5)
    assert resp.status_code == 200
    cancelled = resp.json()
    assert cancelled["id"] == queued.id and cancelled["status"] == "cancelled" and cancelled["output"] == []
    wait_until_sync(lambda: running(base_url) == 0, what="cancelled run aborted")
    assert _get(base_url, queued.id)["status"] == "cancelled"
    again = httpx.post(f"{base_url}/v1/responses/{queued.id}/cancel", timeout=5)
    assert again.status_code == 400 and again.json()["error"]["param"] == "response_id"
    missing = httpx.post(f"{base_url}/v1/responses/resp_nope/cancel", timeout=5)
    assert missing.status_code == 404


def test_a_background_stream_is_recorded_and_replayed(base_url: str) -> None:
    body = {"model": MODEL, "input": "stream it", "max_output_tokens": 4, "background": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        events = _events(resp)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[0]["response"]["background"] is True
    assert events[-1]["type"] == "response.completed"
    response_id = events[-1]["response"]["id"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert len(text) == 4 and _get(base_url, response_id)["output"][0]["content"][0]["text"] == text
    url = f"{base_url}/v1/responses/{response_id}"
    with httpx.stream("GET", url, params={"stream": "true"}, timeout=10) as replay:
        assert replay.status_code == 200 and _events(replay) == events
    with httpx.stream("GET", url, params={"stream": "true", "starting_after": "2"}, timeout=10) as replay:
        assert _events(replay) == events[3:]


def test_a_background_stream_runs_on_without_its_client(base_url: str) -> None:
    body = {"model": MODEL, "input": "go on", "max_output_tokens": 300, "background": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    response_id = first["response"]["id"]
    done = wait_until_sync(
        lambda: (stored := _get(base_url, response_id))["status"] != "queued" and stored,
        what="background stream finished after its client left",
    )
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 300


def test_a_background_response_without_store_stays_queued(client: openai.OpenAI, base_url: str) -> None:
    # vLLM stores a background response's queued object whatever `store` says, and its run stores
    # the finished one only with `store`: without it, the queued object is all there ever is.
    before = ran_to_limit(base_url)
    queued = client.responses.create(
        model=MODEL, input="not kept", max_output_tokens=3, background=True, store=False
    )
    wait_until_sync(lambda: ran_to_limit(base_url) > before, what="background run ended")
    assert _get(base_url, queued.id)["status"] == "queued"


def test_cancel_stops_a_background_stream(base_url: str) -> None:
    body = {
        "model": MODEL,
        "input": "long stream",
        "max_output_tokens": LONG,
        "background": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        while "output_text.delta" not in next(lines):
            pass
        response_id = first["response"]["id"]
        cancelled = httpx.post(f"{base_url}/v1/responses/{response_id}/cancel", timeout=5)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        wait_until_sync(lambda: running(base_url) == 0, what="cancelled stream aborted")
    # vLLM's replay waits for a `response.completed` that never comes: the client leaves.
    assert _get(base_url, response_id)["status"] == "cancelled"
