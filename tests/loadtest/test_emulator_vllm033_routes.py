"""The emulator's vLLM 0.33 routes, straight (no gateway): ids named as vLLM names them (the
`X-Request-Id` header first, then the body's `request_id`), and the decision routes' refusal of
fields their vLLM models do not have (`extra="forbid"`), which the gateway must never add."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

MODEL = "emu-033"
CHAT = [{"role": "user", "content": "hi"}]
QUESTIONS = [{"type": "predicate", "instructions": "Is it urgent?"}]


def post(
    base_url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=10)


def test_answers_are_named_after_the_header_then_the_body(base_url: str) -> None:
    batch = {"messages": [CHAT], "max_tokens": 2, "request_id": "from-body"}
    assert post(base_url, "/v1/chat/completions/batch", batch).json()["id"] == "chatcmpl-from-body"
    named = post(base_url, "/v1/chat/completions/batch", batch, {"x-request-id": "from-header"})
    assert named.json()["id"] == "chatcmpl-from-header"
    decision = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
    assert post(base_url, "/v1/systemone", decision, {"x-request-id": "h"}).json()["id"] == "decision-h"
    scoring = {"query": "q", "items": ["a"], "label_token_ids": [1], "request_id": "b"}
    assert post(base_url, "/generative_scoring", scoring).json()["id"] == "generative-scoring-b"


@pytest.mark.parametrize("extra", ["priority", "request_id", "stream"])
def test_decisions_refuse_fields_their_model_lacks(base_url: str, extra: str) -> None:
    body = {"model": MODEL, "input": "s", "questions": QUESTIONS, extra: 1}
    refused = post(base_url, "/v1/decisions", body)
    assert refused.status_code == 400 and "Extra inputs are not permitted" in refused.text
    del body[extra]
    assert post(base_url, "/v1/decisions", body).status_code == 200


def test_systemone_refuses_unknown_fields_but_takes_priority(base_url: str) -> None:
    body = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}, "priority": 2}
    assert post(base_url, "/v1/systemone", body).status_code == 200
    assert post(base_url, "/v1/systemone", {**body, "stream": False}).status_code == 400
