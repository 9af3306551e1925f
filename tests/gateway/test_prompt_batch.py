"""A batch of prompts (`gateway.prompt_batch`): every prompt decodes every choice, and every
prompt counts in the tenant's tpm and the worker's load, though only the first is keyed. A batch
of 3,000 one-word prompts was 3,000 sequences past a bound of 128 choices, and 50 prompts passed a
tpm quota that one prompt of the same text exceeded."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.admission import Refused, admit
from gateway.auth import hash_api_key
from gateway.bodies import output_budget, parse_body
from gateway.errors import ApiError
from gateway.gate import Gate
from gateway.prompt_batch import batch_tokens, fanout_tokens
from gateway.request_head import RequestIds
from gateway.routes import ROUTES
from policies import make_policy
from tests.support.inprocess import InProcessGateway, gateway_in_process

SECRET = b"k"
COMPLETIONS = ROUTES["/v1/completions"]
GENERATE = ROUTES["/generate"]
CHAT_BATCH = ROUTES["/v1/chat/completions/batch"]


def _refusal(body: dict[str, Any], route: Any = COMPLETIONS) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_body(orjson.dumps(body), route, max_choices=128)
    return err.value


def test_a_batch_counts_its_sequences_against_the_choice_bound() -> None:
    err = _refusal({"model": "m", "prompt": ["x"] * 3000})
    assert (err.status, err.code, err.param) == (400, "integer_above_max_value", "prompt")
    assert "batch of 3000 prompts with 1 choices" in err.message
    assert _refusal({"model": "m", "prompt": ["x"] * 100, "n": 2}).param == "prompt"
    assert _refusal({"model": "m", "prompt": [[1, 2]] * 65, "best_of": 2}).param == "prompt"
    parse_body(orjson.dumps({"model": "m", "prompt": ["x"] * 64, "n": 2}), COMPLETIONS, max_choices=128)
    parse_body(orjson.dumps({"model": "m", "prompt": list(range(5000))}), COMPLETIONS, max_choices=128)


def test_each_sampling_params_entry_of_a_generate_batch_is_checked() -> None:
    body = {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 100000}]}
    err = _refusal(body, GENERATE)
    assert (err.status, err.param) == (400, "sampling_params[1].n")
    err = _refusal({"text": ["a"] * 70, "sampling_params": [{"n": 2}] * 70}, GENERATE)
    assert err.param == "text"


def test_the_output_budget_and_the_tokens_count_every_prompt() -> None:
    body = {"model": "m", "prompt": ["abcd", "abcdabcd", "abcd"], "max_tokens": 10, "n": 2}
    assert output_budget(body, "completions", None) == 60
    assert batch_tokens(body, "completions", 1, 4) == 4  # the first's 1, then 8 and 4 characters
    assert batch_tokens({"prompt": "one"}, "completions", 7, 4) == 7
    assert batch_tokens({"text": [[1, 2], [3, 4, 5, 6]]}, "generate", 2, 4) == 6
    listed = {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 5}, {"max_tokens": 9, "n": 2}]}
    assert output_budget(listed, "generate", None) == 9 * 2 * 2
    with pytest.raises(ApiError) as err:
        output_budget({"text": "a", "sampling_params": [{"max_new_tokens": 10**6}]}, "generate", 4096)
    assert err.value.param == "sampling_params[0].max_new_tokens"
    # Each prompt on its own: a short first prompt does not make the batch short.
    assert batch_tokens({"prompt": ["", "x" * 4000, "x" * 4000]}, "completions", 0, 4) == 2000


def test_a_batch_of_chat_completions_counts_its_conversations() -> None:
    conversation = [{"role": "user", "content": "x"}]
    err = _refusal({"model": "m", "messages": [conversation] * 129}, CHAT_BATCH)
    assert (err.status, err.code, err.param) == (400, "integer_above_max_value", "messages")
    assert "batch of 129 conversations with 1 choices" in err.message
    assert _refusal({"model": "m", "messages": [conversation] * 65, "n": 2}, CHAT_BATCH).param == "messages"
    # One conversation sent as a list of messages is one, as one prompt of a completions batch is.
    parse_body(orjson.dumps({"model": "m", "messages": conversation * 200}), CHAT_BATCH, max_choices=128)
    body = {"model": "m", "messages": [conversation] * 3, "max_tokens": 10}
    assert output_budget(body, None, None, "conversations") == 30
    assert output_budget({**body, "max_completion_tokens": 2}, None, None, "conversations") == 6
    assert output_budget({**body, "max_tokens": 10**9}, None, None, "conversations") == 3 * 131_072


def test_what_every_read_repeats_counts_once_per_read() -> None:
    scoring = {"query": "x" * 400, "items": ["a", "b", "c"]}
    assert fanout_tokens(scoring, "items", 110, 4) == 110 + 2 * 100
    assert fanout_tokens({**scoring, "query": list(range(50))}, "items", 60, 4) == 60 + 2 * 50
    assert fanout_tokens({**scoring, "items": ["a"]}, "items", 110, 4) == 110
    state = {"state": {"k": "v" * 92}, "instructions": "y" * 40, "questions": {"a": {}, "b": {}}}
    assert fanout_tokens(state, "state_questions", 50, 4) == 50 + (25 + 10)
    decisions = {"input": [{"role": "user", "content": "z" * 100}], "questions": [{}] * 4}
    assert fanout_tokens(decisions, "input_questions", 40, 4) == 40 + 3 * 33
    # A batch of conversations shares nothing: its body counts each conversation once.
    assert fanout_tokens({"messages": [[{}]] * 9}, "conversations", 70, 4) == 70
    # Not a list of items or questions: the worker's 400, the body's size meanwhile.
    assert fanout_tokens({"query": "x" * 400, "items": "abc"}, "items", 110, 4) == 110


@contextlib.asynccontextmanager
async def _gateway() -> AsyncIterator[InProcessGateway]:
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")], "quotas": {"tpm": 2000}}],
        "scrape": {"enabled": False},
    }
    async with gateway_in_process(config, make_policy("cost"), secret=SECRET, workers_up=False) as gw:
        yield gw


async def _admit(gate: Gate, body: dict[str, Any]) -> Any:
    return await admit(
        orjson.dumps(body), COMPLETIONS, gate, RequestIds("r", None), gate.keyring.tenants["t"], 0.0
    )


async def test_a_batch_past_the_tpm_quota_is_refused_as_one_prompt_of_its_size_is() -> None:
    text = "word " * 400  # about 500 tokens (approximate mode: 4 characters a token)
    async with _gateway() as gw:
        gate = gw.state.gate
        for body in (
            {"model": "m", "prompt": text * 10},
            {"model": "m", "prompt": [text] * 10},
            {"model": "m", "prompt": ["", *[text] * 10]},  # a short first prompt
        ):
            with pytest.raises(Refused) as refused:
                await _admit(gate, body)
            assert refused.value.error.code == "insufficient_quota"
            # No wait lets it pass: no Retry-After for a client to honour, only x-should-retry.
            headers = refused.value.error.headers
            assert headers["x-should-retry"] == "false" and "retry-after" not in headers
            assert headers["x-ratelimit-remaining-tokens"] == "2000"  # nothing was charged
        admitted = await _admit(gate, {"model": "m", "prompt": [text] * 3})
        assert admitted.route.n_prompt_tokens >= 1500
