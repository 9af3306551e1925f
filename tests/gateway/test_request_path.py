"""In-process request path against a scripted upstream (`request_rig`): salts, request ids, identity
and keys, tokenizer mode, holds, and the worker's accounting of a pending prompt."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.keying import INLINE_PROMPT_BYTES
from policies.base import (
    RouteDecision,
    RouteRequest,
    WorkerView,
    prefill_pairs,
)
from prompt_normalizer.types import PUBLIC_NAMESPACE
from tests.gateway.request_rig import Rig, ScriptedPolicy, request_rig
from tests.support.wait import wait_until


@pytest.fixture
async def rig(tiny_model: Path) -> AsyncIterator[Rig]:
    async with request_rig(tiny_model) as built:
        yield built


async def test_every_request_is_salted_and_a_client_salt_is_replaced(rig: Rig) -> None:
    salts = {}
    for name in ("strict", "shared", "pub"):
        resp = await rig.chat(f"sk-{name}", cache_salt="mine")
        assert resp.status_code == 200
        salts[name] = rig.upstream.received[-1]["body"]["cache_salt"]
    assert len(set(salts.values())) == 3 and "mine" not in salts.values()
    assert salts["strict"] == rig.state.gate.keyring.tenants["strict"].cache_salt
    # Every tenant's own keys live in its own namespace (its KV is salted with its own salt).
    assert [r.namespace for r in rig.policy.requests] == ["tenant:strict", "tenant:shared", "tenant:pub"]


async def test_public_salt_only_when_the_whole_prompt_is_in_promoted_blocks(rig: Rig) -> None:
    system = {"role": "system", "content": "S" * 400}  # 100 approximate tokens: 6 full blocks
    rig.policy.shared_blocks = 6
    public_salt = rig.state.gate.keyring.public_salt
    # A prompt with a private tail after the promoted prefix keeps the tenant's salt.
    resp = await rig.chat("sk-shared", messages=[system, {"role": "user", "content": "a private question"}])
    assert resp.status_code == 200
    req = rig.policy.requests[-1]
    assert req.public_block_keys and req.n_prompt_tokens > 6 * req.block_size_tokens
    assert (
        rig.upstream.received[-1]["body"]["cache_salt"] == rig.state.gate.keyring.tenants["shared"].cache_salt
    )
    # A policy claiming more shared blocks than the request has is not trusted.
    rig.policy.shared_blocks = 10_000
    resp = await rig.chat("sk-shared", messages=[system])
    assert rig.upstream.received[-1]["body"]["cache_salt"] != public_salt
    # Never for a strict tenant (the rule itself: tests/policies/test_identity.py).
    resp = await rig.chat("sk-strict", messages=[system])
    assert (
        rig.upstream.received[-1]["body"]["cache_salt"] == rig.state.gate.keyring.tenants["strict"].cache_salt
    )
    assert rig.state.gate.keyring.salt_namespaces[public_salt] == PUBLIC_NAMESPACE


async def test_internal_request_id_is_sent_upstream_and_the_client_id_only_echoed(rig: Rig) -> None:
    ids = []
    for _ in range(2):
        resp = await rig.chat(headers={"x-request-id": "same-client-id"})
        assert resp.headers["x-request-id"] == "same-client-id"
        ids.append(rig.upstream.received[-1]["request_id"])
    assert len(set(ids)) == 2 and "same-client-id" not in ids
    assert [r.request_id for r in rig.policy.requests] == ids


async def test_engine_internal_fields_are_refused(rig: Rig) -> None:
    for name in (
        "kv_transfer_params",
        "rid",
        "data_parallel_rank",
        "prompt_embeds",
        "routed_dp_rank",
        "disagg_prefill_dp_rank",
        "custom_logit_processor",
        "session_params",
    ):
        resp = await rig.chat(**{name: 1})
        assert resp.status_code == 400
        error = orjson.loads(resp.content)["error"]
        assert error["param"] == name and name in error["message"]
    assert rig.upstream.received == []


async def test_identity_fields_and_adapter_are_bound_into_the_keys(rig: Rig) -> None:
    pool = rig.state.registry.pools["p"]
    tenant = rig.state.gate.keyring.tenants["shared"]
    own, public = rig.state.gate.keying.identities(pool, "m", tenant)
    assert (own.weights_version, own.epoch, own.namespace, own.adapter) == ("w1", 3, "tenant:shared", "")
    assert public is not None and public == own.__class__(**{**_fields(own), "namespace": PUBLIC_NAMESPACE})
    lora, _ = rig.state.gate.keying.identities(pool, "m-lora", tenant)
    assert (lora.model_id, lora.adapter) == ("m", "sql-lora")
    strict_own, strict_public = rig.state.gate.keying.identities(
        pool, "m", rig.state.gate.keyring.tenants["strict"]
    )
    assert strict_public is None and strict_own.namespace == "tenant:strict"
    await rig.chat(model="m-lora")
    assert rig.policy.requests[-1].adapter == "sql-lora"
    a = await rig.chat(messages=[{"role": "system", "content": "S" * 200}])
    b = await rig.chat(model="m-lora", messages=[{"role": "system", "content": "S" * 200}])
    assert a.status_code == b.status_code == 200
    assert not set(rig.policy.requests[-1].block_keys) & set(rig.policy.requests[-2].block_keys)


async def test_a_session_key_reaches_the_policy_scoped_by_tenant(rig: Rig) -> None:
    for name in ("strict", "shared"):
        assert (await rig.chat(f"sk-{name}", prompt_cache_key="conv-1")).status_code == 200
    assert [r.session_key for r in rig.policy.requests] == ["tenant:strict/conv-1", "tenant:shared/conv-1"]
    await rig.chat(prompt_cache_key=7)  # not a string: no session
    assert rig.policy.requests[-1].session_key is None


def _fields(identity: Any) -> dict[str, Any]:
    return {name: getattr(identity, name) for name in identity.__dataclass_fields__}


def _keying_threads(rig: Rig, pool: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads `pool`'s normalizer canonicalizes on, one per request, from now."""
    normalizer = rig.state.gate.keying.normalizers[pool]
    real = normalizer.canonicalize
    threads: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(normalizer, "canonicalize", recording)
    return threads


async def test_tokenizer_mode_runs_off_the_event_loop(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _keying_threads(rig, "tok", monkeypatch)
    for _ in range(2):
        resp = await rig.chat(model="m-tok", messages=[{"role": "user", "content": "hello there " * 500}])
        assert resp.status_code == 200
    assert len(threads) == 2 and all(t.startswith("kvgate-normalizer") for t in threads)
    assert rig.policy.requests[-1].n_prompt_tokens > 500


async def test_a_large_body_is_keyed_off_the_event_loop_in_approximate_mode(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _keying_threads(rig, "p", monkeypatch)
    small = "hello there " * 100
    large = "x " * (INLINE_PROMPT_BYTES // 2 + 1)
    for content in (small, large):
        assert (await rig.chat(messages=[{"role": "user", "content": content}])).status_code == 200
    assert threads == [threading.current_thread().name]  # a small body: keyed where it is read
    assert rig.state.gate.keying.processes.started == 1  # a large one: in the keying process


@dataclass
class HoldingPolicy(ScriptedPolicy):
    """Asks for every request to be held `hold` seconds first (`policies.peer_sync.SupportsHold`),
    and records when it was asked and when it decided."""

    hold: float = 0.05
    asked_s: list[float] = field(default_factory=list)
    decided_s: list[float] = field(default_factory=list)

    def hold_s(self, req: RouteRequest, now_s: float) -> float:
        self.asked_s.append(now_s)
        return self.hold

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        self.decided_s.append(now_s)
        return super().select(req, workers, now_s)


async def test_a_request_the_policy_holds_is_decided_after_the_hold_and_served(rig: Rig) -> None:
    policy = HoldingPolicy()
    rig.state.routing.policy = policy  # as a reload swaps it
    resp = await rig.chat()
    assert resp.status_code == 200
    (asked,), (decided,) = policy.asked_s, policy.decided_s
    assert decided - asked >= 0.9 * policy.hold  # the sleep's clock may round a little early
    policy.hold = 0.0
    assert (await rig.chat()).status_code == 200
    assert len(policy.asked_s) == len(policy.decided_s) == 2
    assert rig.state.routing.hold_s(policy.requests[-1], 0.0) == 0.0
    rig.state.routing.policy = rig.policy  # a policy without `hold_s` is never held
    assert rig.state.routing.hold_s(policy.requests[-1], 0.0) == 0.0
    assert (await rig.chat()).status_code == 200


@dataclass
class MatchingPolicy(ScriptedPolicy):
    """Predicts `matched` cached tokens on the worker it picks."""

    matched: int = 0

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        decision = super().select(req, workers, now_s)
        if decision is None:
            return None
        return dataclasses.replace(decision, matched_tokens=min(self.matched, req.n_prompt_tokens))


async def test_a_pending_prompts_attention_is_counted_with_its_predicted_match_until_its_first_token(
    rig: Rig,
) -> None:
    policy = MatchingPolicy(matched=2)
    rig.state.routing.policy = policy
    rig.upstream.gate = asyncio.Event()
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    pending = asyncio.create_task(rig.chat(stream=True))
    pairs = await wait_until(lambda: worker.prefill_pairs, what="the prompt is pending on the worker")
    (r,) = policy.requests
    assert r.n_prompt_tokens > 2 and pairs == prefill_pairs(r.n_prompt_tokens, 2)
    assert worker.view(0.0).in_flight_prefill_pairs == pairs
    rig.upstream.gate.set()
    assert (await pending).status_code == 200
    assert worker.prefill_pairs == 0 and worker.prefill_tokens == 0 and worker.in_flight == 0
