"""Claude Code's Messages requests through the gateway to an emulated worker that reads them as
current vLLM does: a `system` message inside `messages`, the roles `ctx` and `msg` (a user's), and
a per-request billing header in the system prompt, which neither the worker's prompt nor the
gateway's keys contain, so a conversation's turns keep landing on the worker that holds it."""

from __future__ import annotations

from typing import Any

from policies.baselines import RoundRobin
from tests.support.gateway_config import SECRET, tenant
from tests.support.inprocess import gateway_in_process

HEADERS = {"x-api-key": "sk-a", "anthropic-version": "2023-06-01"}
SYSTEM = "You are a careful coding assistant who reads the whole file first. " * 8


def _body(billing: str, turns: list[dict[str, Any]]) -> dict[str, Any]:
    system = [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={billing};"},
        {"type": "text", "text": SYSTEM},
    ]
    return {"model": "m", "max_tokens": 4, "system": system, "messages": turns}


async def test_inline_system_messages_other_roles_and_the_billing_header_are_served(emulator: str) -> None:
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": [emulator]}],
        "tenants": [tenant("a", "sk-a")],
        "scrape": {"enabled": False},
    }
    turns = [
        {"role": "user", "content": "Read main.py."},
        {"role": "system", "content": [{"type": "text", "text": "The user is in plan mode."}]},
        {"role": "ctx", "content": "main.py has 40 lines."},
    ]
    async with gateway_in_process(config, RoundRobin(), secret=SECRET) as gw:
        first = await gw.client.post("/v1/messages", json=_body("aaa111", turns), headers=HEADERS)
        assert first.status_code == 200, first.text
        assert first.json()["type"] == "message"
        assert first.headers["request-id"] == first.headers["x-request-id"]  # the Anthropic SDKs' name
        refused = await gw.client.post("/v1/messages", json=_body("x", turns), headers={"x-api-key": "sk-no"})
        assert refused.status_code == 401 and refused.headers["request-id"] == refused.headers["x-request-id"]
        turns += [{"role": "assistant", "content": "Done."}, {"role": "msg", "content": "Now test it."}]
        second = await gw.client.post("/v1/messages", json=_body("bbb222", turns), headers=HEADERS)
        assert second.status_code == 200, second.text
        # The worker's prompt differs by the billing header no more than the keys do: the second
        # turn reads the first turn's prompt from cache.
        usage = second.json()["usage"]
        assert usage["cache_read_input_tokens"] >= first.json()["usage"]["input_tokens"] // 2
