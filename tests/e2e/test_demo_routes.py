"""Every route family end to end on `kvgate serve --demo` (real processes: the gateway and two
emulated vLLM workers), with the OpenAI and Anthropic SDKs as clients use them."""

from __future__ import annotations

import io
import json
import struct
import sys
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.harness import Proc, free_port, start, wait_http

KEY = "sk-e2e-routes"
MODEL = "kvgate-demo"
SYSTEM = "You are a terse assistant who answers in one sentence. " * 24  # ~1.3k tokens, many blocks


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[str, Proc]]:
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--demo", "--workers", "2", "--port", str(port)]
    proc = start([*argv, "--demo-key", KEY, "--metrics-port", "0"])
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=40)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _access_lines(proc: Proc, endpoint: str, count: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The last `count` access-log lines of `endpoint` (the log is flushed every 0.2 s)."""
    deadline = time.monotonic() + timeout_s
    lines: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        lines = []
        for line in proc.output().splitlines():
            if line.startswith("{") and f'"endpoint":"{endpoint}"' in line:
                record = json.loads(line)
                if record.get("logger") == "kvgate.access":
                    lines.append(record)
        if len(lines) >= count:
            return lines[-count:]
        time.sleep(0.1)
    raise AssertionError(f"only {len(lines)} access lines for {endpoint}")


def test_models_retrieve_and_list(demo: tuple[str, Proc]) -> None:
    client = _openai(demo[0])
    assert client.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(demo[0] + "/health", timeout=5).json() == {"status": "ok"}
    assert httpx.get(demo[0] + "/version", timeout=5).json()["version"]


def test_embeddings(demo: tuple[str, Proc]) -> None:
    reply = _openai(demo[0]).embeddings.create(model=MODEL, input=["a cat sat", "a cat sat on a mat"])
    assert [d.index for d in reply.data] == [0, 1] and len(reply.data[0].embedding) == 1024
    assert reply.usage.prompt_tokens > 0


def test_completions_with_a_list_of_prompts_and_n_2(demo: tuple[str, Proc]) -> None:
    client = _openai(demo[0])
    batch = client.completions.create(model=MODEL, prompt=["first prompt", "second prompt"], max_tokens=4)
    assert sorted(c.index for c in batch.choices) == [0, 1] and all(c.text for c in batch.choices)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two answers"}], n=2, max_tokens=4, logprobs=True
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content


def test_responses_follow_ups_land_on_the_worker_holding_them(demo: tuple[str, Proc]) -> None:
    base, proc = demo
    client = _openai(base)
    first = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="What is a KV cache?", max_output_tokens=8
    )
    assert first.output_text and first.id.startswith("resp_")
    # Streamed, then continued: each follow-up must find the previous response on its worker (the
    # other worker answers 404 for an id it never stored).
    previous = first.id
    with client.responses.stream(
        model=MODEL,
        instructions=SYSTEM,
        input="And prefill?",
        previous_response_id=previous,
        max_output_tokens=8,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert deltas and streamed.output_text == "".join(deltas)
    previous = streamed.id
    cached = []
    for question in ("And decode?", "And batching?"):
        reply = client.responses.create(
            model=MODEL,
            instructions=SYSTEM,
            input=question,
            previous_response_id=previous,
            max_output_tokens=8,
        )
        assert reply.output_text and reply.usage is not None
        cached.append(reply.usage.input_tokens_details.cached_tokens)
        previous = reply.id
    assert min(cached) > 0  # the conversation so far came from the holder's prefix cache
    lines = _access_lines(proc, "responses", 4)
    assert len({line["worker"] for line in lines}) == 1  # one worker held the whole conversation
    assert [line["reason"] for line in lines[1:]] == ["response_affinity"] * 3  # pinned, not by chance
    stored = httpx.get(
        f"{base}/v1/responses/{previous}", headers={"authorization": f"Bearer {KEY}"}, timeout=10
    )
    assert stored.status_code == 200 and stored.json()["id"] == previous


def _wav(seconds: float) -> bytes:
    frames = int(16000 * seconds)
    header = (
        b"RIFF"
        + struct.pack("<I", 36 + 2 * frames)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, 16000, 32000, 2, 16)
    )
    return header + b"data" + struct.pack("<I", 2 * frames) + bytes(2 * frames)


def test_audio_tokenizer_score_and_rerank_routes(demo: tuple[str, Proc]) -> None:
    base, _ = demo
    text = _openai(base).audio.transcriptions.create(model=MODEL, file=("a.wav", io.BytesIO(_wav(0.5))))
    assert text.text
    headers = {"authorization": f"Bearer {KEY}"}
    tokens = httpx.post(
        base + "/tokenize", json={"model": MODEL, "prompt": "hello"}, headers=headers, timeout=10
    )
    assert tokens.status_code == 200 and tokens.json()["count"] == 5
    back = httpx.post(
        base + "/detokenize",
        json={"model": MODEL, "tokens": tokens.json()["tokens"]},
        headers=headers,
        timeout=10,
    )
    assert back.json()["prompt"] == "hello"
    rerank = httpx.post(
        base + "/v1/rerank",
        json={"model": MODEL, "query": "cat", "documents": ["a cat", "a car"]},
        headers=headers,
        timeout=10,
    )
    assert rerank.status_code == 200 and len(rerank.json()["results"]) == 2
    score = httpx.post(
        base + "/score",
        json={"model": MODEL, "text_1": "cat", "text_2": ["a cat", "a car"]},
        headers=headers,
        timeout=10,
    )
    assert score.status_code == 200 and len(score.json()["data"]) == 2


def test_anthropic_messages_with_cache_control_hit_the_cache_the_second_time(demo: tuple[str, Proc]) -> None:
    base, _ = demo
    client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=30)  # sends x-api-key
    # A system prompt of its own: the first request creates its cache, the second reads it.
    long_system = "You review code and reply with one short remark. " * 26
    system: Any = [{"type": "text", "text": long_system, "cache_control": {"type": "ephemeral"}}]
    usages = []
    for question in ("What is a KV cache?", "What is prefill?"):
        reply = client.messages.create(
            model=MODEL, max_tokens=8, system=system, messages=[{"role": "user", "content": question}]
        )
        assert reply.content and reply.content[0].type == "text"
        usages.append(reply.usage)
    assert usages[0].cache_creation_input_tokens and usages[0].cache_creation_input_tokens > 0
    assert usages[1].cache_read_input_tokens and usages[1].cache_read_input_tokens > 0
    with client.messages.stream(
        model=MODEL, max_tokens=8, system=system, messages=[{"role": "user", "content": "Streamed?"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0
    wrong = anthropic.Anthropic(base_url=base, api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}])
    body = info.value.body
    assert (
        isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    )
