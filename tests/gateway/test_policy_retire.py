"""A policy a reload replaced lets go of what it learned: whatever still refers to it (a request
dispatched before the swap, the start-up frames of `kvgate serve`, objects `gc.freeze` made
permanent) must not keep its prefix index alive, reload after reload."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.state import GatewayState, build_state
from policies.base import Observation, RoutingPolicy, WorkerId, WorkerView
from policies.config import build_policy, parse_policy_yaml
from policies.prefix_policy import PrefixPolicyBase
from prompt_normalizer.normalizer import NormalizerConfig
from tests.policies.factories import req

W = [WorkerView(WorkerId(f"w{i}")) for i in range(2)]


@pytest.fixture
def no_cycle_collection() -> Iterator[None]:
    # Only reference counting frees anything here: what a cycle or a frozen object keeps stays.
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _state(policy: RoutingPolicy) -> GatewayState:
    config = parse_config(
        {
            "pools": [{"name": "p", "models": ["m"], "workers": ["http://10.0.0.1:8000"]}],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}],
        }
    )
    return build_state(config, b"k", policy, NormalizerConfig())


def _learn(policy: RoutingPolicy) -> weakref.ref[object]:
    for i in range(20):
        r = req(f"r{i}", range(i * 1000, i * 1000 + 64))
        d = policy.select(r, W, 1.0)
        assert d is not None
        policy.on_dispatch(r, d, 1.0)
        policy.on_complete(Observation(r, d.worker, 0.5, r.n_prompt_tokens, 0), 1.5)
    assert isinstance(policy, PrefixPolicyBase)
    index = policy._pool(req("x", range(2))).index
    assert index.stats().keys > 0
    return weakref.ref(index)


@pytest.mark.parametrize("kind", ["cost", "preble_e2"])
def test_a_replaced_policy_keeps_no_index_alive(no_cycle_collection: None, kind: str) -> None:
    first = build_policy(parse_policy_yaml(f"policy: {kind}\n"))
    state = _state(first)
    first_index = _learn(first)
    # A normalizer change: nothing is keyed as before, so nothing is taken over.
    second = build_policy(parse_policy_yaml(f"policy: {kind}\n"))
    state.set_policy(second, NormalizerConfig(chars_per_token=3.0))
    assert first_index() is None  # though `first` is still referred to, here
    second_index = _learn(second)
    state.set_policy(
        build_policy(parse_policy_yaml(f"policy: {kind}\n")), NormalizerConfig(chars_per_token=2.0)
    )
    assert second_index() is None
    assert state.routing.policy is not second and first.select(req("y", range(64)), W, 3.0) is not None


def test_an_index_taken_over_lives_on_in_the_new_policy(no_cycle_collection: None) -> None:
    first = build_policy(parse_policy_yaml("policy: cost\n"))
    state = _state(first)
    index = _learn(first)
    second = build_policy(parse_policy_yaml("policy: cost\ncost: {epsilon: 0.8}\n"))
    assert state.set_policy(second, NormalizerConfig()) == ["p"]
    assert index() is not None and second._pool(req("x", range(2))).index is index()  # type: ignore[attr-defined]
    r = req("f", range(0, 80))
    d = second.select(r, W, 2.0)
    assert d is not None and d.matched_tokens >= 64 * 16  # retiring `first` emptied nothing shared


def test_the_routing_forgets_the_replaced_policys_hold_check() -> None:
    first = build_policy(parse_policy_yaml("policy: cost\n"))
    state = _state(first)
    assert state.routing.hold_s(req("a", range(64)), 0.0) == 0.0  # checked, and remembered
    assert state.routing._hold_checked is first
    state.set_policy(build_policy(parse_policy_yaml("policy: round_robin\n")), NormalizerConfig())
    assert state.routing._hold_checked is None and state.routing._holder is None
