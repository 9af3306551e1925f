"""Every answer to a tenant with an rpm or tpm quota carries OpenAI's `x-ratelimit-*` headers
(limit, remaining, reset, for requests and for tokens), whole answers and streams alike, and so
does a quota's 429; a tenant without quotas gets none. (The Messages routes carry Anthropic's
instead: test_anthropic_rate_limit_headers.py.) The metrics say the same per tenant
(`kvgate_tenant_quota_remaining`)."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import QuotaConfig
from gateway.gauges import refresh_gauges
from gateway.quotas import TenantLimiter
from gateway.rate_buckets import go_duration
from policies.baselines import RoundRobin
from tests.gateway.routes_rig import SECRET as RIG_SECRET
from tests.gateway.routes_rig import routes_rig
from tests.support.gateway_config import SECRET, tenant
from tests.support.inprocess import gateway_in_process

LIMITED = {"authorization": "Bearer sk-limited"}
FREE = {"authorization": "Bearer sk-free"}


def _config(url: str) -> dict[str, object]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": [url]}],
        "tenants": [
            tenant("limited", "sk-limited", quotas={"rpm": 3, "tpm": 100_000}),
            tenant("free", "sk-free"),
        ],
        "scrape": {"enabled": False},
    }


def _limits(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.startswith("x-ratelimit-")}


@pytest.mark.parametrize(
    ("seconds", "written"),
    [
        (0, "0s"),
        (0.12, "120ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (59.9994, "59.999s"),
        (360, "6m0s"),
        (3723, "1h2m3s"),
    ],
)
def test_reset_times_are_written_as_openai_writes_them(seconds: float, written: str) -> None:
    assert go_duration(seconds) == written


def test_a_limiter_says_what_is_left_and_when_it_is_full_again() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=60, tpm=6000), now_s=0.0)
    assert lim.enter(0.0) is None and lim.admit(600, 0.0) is None
    assert dict(lim.rate_headers(0.0)) == {
        b"x-ratelimit-limit-requests": b"60",
        b"x-ratelimit-remaining-requests": b"59",
        b"x-ratelimit-reset-requests": b"1s",  # one a second comes back
        b"x-ratelimit-limit-tokens": b"6000",
        b"x-ratelimit-remaining-tokens": b"5400",
        b"x-ratelimit-reset-tokens": b"6s",
    }
    assert TenantLimiter(QuotaConfig(max_concurrent=2), now_s=0.0).rate_headers(0.0) == []


async def test_answers_and_the_quotas_429_carry_the_tenants_rate_limits(emulator: str) -> None:
    async with gateway_in_process(_config(emulator), RoundRobin(), secret=SECRET) as gw:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        first = await gw.client.post("/v1/chat/completions", json=chat, headers=LIMITED)
        assert first.status_code == 200, first.text
        limits = _limits(first)
        assert limits["x-ratelimit-limit-requests"] == "3" and limits["x-ratelimit-remaining-requests"] == "2"
        assert limits["x-ratelimit-limit-tokens"] == "100000"
        assert int(limits["x-ratelimit-remaining-tokens"]) < 100_000  # the prompt was charged
        assert limits["x-ratelimit-reset-requests"].endswith("s")
        streamed = await gw.client.post(
            "/v1/chat/completions", json={**chat, "stream": True}, headers=LIMITED
        )
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        assert _limits(streamed)["x-ratelimit-remaining-requests"] == "1"
        await gw.client.post("/v1/chat/completions", json=chat, headers=LIMITED)
        refused = await gw.client.post("/v1/chat/completions", json=chat, headers=LIMITED)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert _limits(refused)["x-ratelimit-remaining-requests"] == "0"
        assert "retry-after" in refused.headers
        free = await gw.client.post("/v1/chat/completions", json=chat, headers=FREE)
        assert free.status_code == 200 and _limits(free) == {}
        refresh_gauges(gw.state)
        text = gw.state.routing.metrics.render().decode()
        remaining = [line for line in text.splitlines() if line.startswith("kvgate_tenant_quota_remaining{")]
        requests = next(line for line in remaining if 'quota="requests"' in line)
        assert 'tenant="limited"' in requests and 0 <= float(requests.split()[-1]) < 1
        assert any('quota="tokens"' in line for line in remaining)
        assert not any('tenant="free"' in line for line in remaining)  # no quota, no series


async def test_the_stored_response_routes_carry_them_too() -> None:
    tenants = [tenant("t", "sk-t", secret=RIG_SECRET, quotas={"rpm": 3})]
    async with routes_rig(tenants=tenants) as rig:
        key = {"authorization": "Bearer sk-t"}
        created = await rig.client.post("/v1/responses", json={"model": "m", "input": "hello"}, headers=key)
        assert created.status_code == 200, created.text
        assert _limits(created)["x-ratelimit-remaining-requests"] == "2"
        stored = await rig.client.get(f"/v1/responses/{created.json()['id']}", headers=key)
        assert stored.status_code == 200, stored.text
        assert _limits(stored)["x-ratelimit-remaining-requests"] == "1"
        await rig.client.get(f"/v1/responses/{created.json()['id']}", headers=key)
        refused = await rig.client.get(f"/v1/responses/{created.json()['id']}", headers=key)
        assert refused.status_code == 429 and _limits(refused)["x-ratelimit-remaining-requests"] == "0"
        assert "retry-after" in refused.headers


async def test_the_gateways_own_errors_after_admission_carry_them() -> None:
    # Port 1 refuses every connection: the request is admitted and charged, then every attempt
    # fails to connect (502). The client still learns where its quota stands.
    async with gateway_in_process(
        _config("http://127.0.0.1:1"), RoundRobin(), secret=SECRET, workers_up=False
    ) as gw:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        failed = await gw.client.post("/v1/chat/completions", json=chat, headers=LIMITED)
        assert failed.status_code in (502, 503), failed.text
        assert "error" in failed.json()
        limits = _limits(failed)
        assert limits["x-ratelimit-limit-requests"] == "3"
        assert limits["x-ratelimit-remaining-requests"] == "2"
        assert limits["x-ratelimit-limit-tokens"] == "100000"
        messages = await gw.client.post(
            "/v1/messages", json={**chat, "max_tokens": 2}, headers={"x-api-key": "sk-limited"}
        )
        assert messages.status_code in (502, 503) and messages.json()["type"] == "error", messages.text
        # The Messages routes tell it in Anthropic's headers (test_anthropic_rate_limit_headers.py).
        assert messages.headers["anthropic-ratelimit-requests-remaining"] == "1"
        assert _limits(messages) == {}
        free = await gw.client.post("/v1/chat/completions", json=chat, headers=FREE)
        assert free.status_code in (502, 503) and _limits(free) == {}
