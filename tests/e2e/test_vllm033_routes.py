"""vLLM 0.33's routes through a real gateway in front of a real emulated vLLM worker: the batch
of chat completions, generative scoring, both decision routes, the Messages and Responses render
routes and the derender routes, answered as vLLM answers them; Cohere's chat, off by default in
vLLM, is not served. What the worker receives on each: `tests/gateway/test_vllm033_routes.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Proc, free_port, start_emulator, start_gateway, tenant, write_gateway_config

KEY = "sk-vllm033-routes"
QUOTA_KEY = "sk-vllm033-routes-tpm"  # a tenant of 100,000 tokens a minute
MODEL = "emu-033"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Say something short."}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway process in front of one emulated vLLM worker (20x speed), with two tenants."""
    emulator, worker = start_emulator("--model", MODEL, "--time-scale", "20")
    procs: list[Proc] = [worker]
    try:
        tenants = [tenant("t", KEY), tenant("q", QUOTA_KEY, quotas={"tpm": 100_000})]
        pools = [{"name": "p", "models": [MODEL], "workers": [emulator]}]
        path = write_gateway_config(Path(tmp_path_factory.mktemp("vllm033")) / "gw.yaml", pools, tenants)
        port = free_port()
        procs.append(start_gateway(path, port))
        yield f"http://127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):
            proc.stop()


def post(base: str, path: str, body: dict[str, Any], headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=headers, timeout=30)


def test_a_batch_of_chat_completions_answers_one_choice_per_conversation(gateway: str) -> None:
    other = [{"role": "user", "content": "And something else."}]
    body = {"model": MODEL, "messages": [CHAT, other, CHAT], "max_tokens": 3, "stream": True}
    answer = post(gateway, "/v1/chat/completions/batch", body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] for c in got["choices"])
    assert got["usage"]["completion_tokens"] <= 9 and got["usage"]["prompt_tokens"] > 0
    refused = post(gateway, "/v1/chat/completions/batch", {**body, "n": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


def test_a_batch_of_chat_completions_is_bounded_by_the_choices_limit(gateway: str) -> None:
    """Each conversation decodes on its own, so the batch runs one sequence per conversation: at
    most `limits.max_choices` (128), as a completions batch (100,000 reached the worker)."""
    body = {"model": MODEL, "messages": [CHAT] * 129, "max_tokens": 2}
    refused = post(gateway, "/v1/chat/completions/batch", body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "integer_above_max_value"
    assert refused.json()["error"]["param"] == "messages"
    answer = post(gateway, "/v1/chat/completions/batch", {**body, "messages": [CHAT] * 128})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 128


def test_generative_scoring_scores_every_item(gateway: str) -> None:
    body = {
        "model": MODEL,
        "query": "Is this about cats? ",
        "items": ["a cat", "a dog"],
        "label_token_ids": [5, 6],
    }
    answer = post(gateway, "/generative_scoring", body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["id"].startswith("generative-scoring-") and [d["index"] for d in got["data"]] == [0, 1]
    assert got["usage"]["prompt_tokens"] > 0 and got["usage"]["completion_tokens"] == 2


def test_generative_scoring_counts_its_query_once_per_item(gateway: str) -> None:
    """The worker prefills the query with every item: 120 items of a 3,500-character query are
    about 105,000 tokens, past a tpm quota of 100,000 (admitted as the body's 1,200 before, the
    worker then prefilling the query 120 times). 129 items are past `limits.max_choices`."""
    quota = {"authorization": f"Bearer {QUOTA_KEY}"}
    query = "word " * 700
    body = {
        "model": MODEL,
        "query": query,
        "items": [f"item {i}" for i in range(120)],
        "label_token_ids": [5],
    }
    refused = post(gateway, "/generative_scoring", body, quota)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "100000"  # nothing charged, nothing ran
    many = post(gateway, "/generative_scoring", {**body, "items": ["a"] * 129}, quota)
    assert many.status_code == 400 and many.json()["error"]["param"] == "items"
    answer = post(gateway, "/generative_scoring", {**body, "items": ["a", "b"]}, quota)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 0


def test_structured_decisions_answer_every_question(gateway: str) -> None:
    questions = {
        "urgent": {"type": "noul", "instructions": "Is it urgent?"},
        "team": {
            "type": "choice",
            "instructions": "Which team?",
            "criteria": {"billing": None, "tech": "bugs"},
        },
    }
    body = {"model": MODEL, "state": "My payouts fail.", "questions": questions, "priority": 3}
    answer = post(gateway, "/v1/systemone", body)
    # The worker refuses unknown fields: the gateway added none (and kept the client's priority).
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["object"] == "structured_decision" and got["id"].startswith("decision-")
    assert got["answers"]["urgent"]["type"] == "noul" and got["answers"]["team"]["choice"] == "billing"
    assert got["usage"]["output_tokens"] == 2


def test_decisions_answer_in_question_order(gateway: str) -> None:
    questions = [
        {"type": "predicate", "instructions": "Is it urgent?"},
        {"type": "score", "instructions": "How bad?", "levels": [{"label": "low"}, {"label": "high"}]},
    ]
    answer = post(
        gateway, "/v1/decisions", {"model": MODEL, "input": "My payouts fail.", "questions": questions}
    )
    # vLLM's decisions model refuses any field it does not have (`priority` among them): a 200
    # means the gateway sent the body with its own `cache_salt` and nothing else added.
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert [a["type"] for a in got["answers"]] == ["predicate", "score"]
    assert got["usage"]["total_tokens"] == got["usage"]["input_tokens"] + got["usage"]["output_tokens"]


def test_messages_and_responses_render_routes(gateway: str) -> None:
    anthropic = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    messages = post(
        gateway, "/v1/messages/render", {"model": MODEL, "max_tokens": 4, "messages": CHAT}, anthropic
    )
    assert messages.status_code == 200, messages.text
    assert messages.json()["token_ids"] and messages.json()["model"] == MODEL
    responses = post(gateway, "/v1/responses/render", {"model": MODEL, "input": "Say something short."})
    assert responses.status_code == 200, responses.text
    assert responses.json()["token_ids"]
    stateful = post(
        gateway, "/v1/responses/render", {"model": MODEL, "input": "x", "previous_response_id": "r"}
    )
    assert stateful.status_code == 400 and stateful.json()["error"]["param"] == "previous_response_id"


def test_derender_routes_decode_a_generate_answer(gateway: str) -> None:
    tokens = post(gateway, "/tokenize", {"model": MODEL, "prompt": "a quiet morning"}).json()["tokens"]
    choice = {"index": 0, "token_ids": tokens, "finish_reason": "stop"}
    chat = post(
        gateway,
        "/v1/chat/completions/derender",
        {
            "model": MODEL,
            "generate_response": {"request_id": "chatcmpl-g1", "choices": [choice]},
            "prompt_tokens": 4,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["id"] == "chatcmpl-g1" and chat.json()["choices"][0]["message"]["content"]
    # `stream` true is one chunk per call, answered as JSON (never relayed as an event stream).
    chunk = post(
        gateway,
        "/v1/chat/completions/derender",
        {
            "model": MODEL,
            "stream": True,
            "generate_chunk": {"request_id": "chatcmpl-g1", "choices": [choice]},
        },
    )
    assert chunk.status_code == 200 and chunk.headers["content-type"].startswith("application/json")
    assert chunk.json()["chunk"]["object"] == "chat.completion.chunk"
    completions = post(
        gateway,
        "/v1/completions/derender",
        {"model": MODEL, "generate_responses": [{"request_id": "cmpl-g2", "choices": [choice]}]},
    )
    assert completions.status_code == 200, completions.text
    assert completions.json()["object"] == "text_completion" and completions.json()["choices"][0]["text"]


def test_cohere_chat_is_not_served(gateway: str) -> None:
    answer = post(gateway, "/cohere/v2/chat", {"model": MODEL, "messages": CHAT})
    assert answer.status_code == 404
