"""Every OpenAI-shaped route of the emulated worker beyond plain chat: a real process on loopback,
driven by the `openai` SDK where it has a method for the route, else by httpx."""

from __future__ import annotations

import base64
import io
import json
import math
import wave
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from loadtest.emulator.chat_template import IMAGE_TOKENS
from loadtest.emulator.pooling import EMBEDDING_DIM

pytestmark = pytest.mark.e2e

MODEL = "emu-routes"


def post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=10)


def test_probes_and_model_card(base_url: str, client: openai.OpenAI) -> None:
    assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{base_url}/version", timeout=5).json()["version"]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completions_batch_of_prompts_and_n(client: openai.OpenAI) -> None:
    prompts = ["first prompt " * 10, "second prompt " * 10, [120] * 50]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6)  # type: ignore[arg-type]
    assert [c.index for c in r.choices] == list(range(6))
    assert all(len(c.text) == 6 and c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text != r.choices[1].text  # two choices of one prompt differ
    assert r.usage is not None
    assert r.usage.prompt_tokens == 130 + 140 + 50  # each prompt counted once, not once per choice
    assert r.usage.completion_tokens == 6 * 6
    again = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6)
    assert again.choices[0].text == r.choices[0].text  # choice 0 is the n=1 answer
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 128  # the batch cached it
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=["a" * 40, "b" * 40], max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    ends = [(c.choices[0].index, c.choices[0].finish_reason) for c in streamed if c.choices]
    assert sorted(i for i, reason in ends if reason == "length") == [0, 1]
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == 6


def test_chat_n_logprobs_request_id_priority_and_images(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "logprobs please " * 4}]
    kwargs: Any = {"logprobs": True, "top_logprobs": 3, "max_tokens": 5, "n": 2}
    a = client.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"request_id": "abc123", "priority": -5}, **kwargs
    )
    assert a.id == "chatcmpl-abc123"
    assert len(a.choices) == 2 and a.usage is not None and a.usage.completion_tokens == 10
    lp = a.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    first = lp.content[0]
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0].token == first.token
    assert first.logprob <= 0 and first.top_logprobs[1].logprob < first.logprob
    assert "".join(t.token for t in lp.content) == a.choices[0].message.content
    b = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    assert b.choices[0].logprobs == lp  # deterministic
    plain = client.completions.create(model=MODEL, prompt="x" * 20, max_tokens=4, logprobs=2)
    clp = plain.choices[0].logprobs
    assert clp is not None and clp.tokens is not None and clp.top_logprobs is not None
    assert clp.text_offset == [0, 1, 2, 3] and len(clp.top_logprobs[0]) == 2
    image: Any = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    with_image = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": image}], max_tokens=2
    )
    text_only = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "what is this?"}], max_tokens=2
    )
    assert with_image.usage is not None and text_only.usage is not None
    assert with_image.usage.prompt_tokens - text_only.usage.prompt_tokens == IMAGE_TOKENS


def test_chat_stream_with_two_choices(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "two streams"}], n=2, max_tokens=4,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts = {0: "", 1: ""}
    for c in chunks:
        if c.choices:
            texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert len(texts[0]) == 4 and len(texts[1]) == 4 and texts[0] != texts[1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_cache_salt_on_completions(client: openai.OpenAI) -> None:
    prompt = "salted completion " * 10
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "t1"})
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "t2"})
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "t1"})
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (a, b, c)]  # type: ignore[union-attr]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] > 100


def test_embeddings_with_the_sdk(client: openai.OpenAI, base_url: str) -> None:
    inputs = ["the cache keeps every prefix", "the cache keeps every prefix it saw", "unrelated words here"]
    r = client.embeddings.create(model=MODEL, input=inputs)  # the SDK asks for base64 and decodes it
    vecs = [np.asarray(d.embedding) for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and all(v.shape == (EMBEDDING_DIM,) for v in vecs)
    assert all(math.isclose(float(np.linalg.norm(v)), 1.0, rel_tol=1e-5) for v in vecs)
    assert float(vecs[0] @ vecs[1]) > float(vecs[0] @ vecs[2])  # shared tokens point the same way
    assert r.usage.prompt_tokens == sum(len(t) for t in inputs) == r.usage.total_tokens
    floats = client.embeddings.create(model=MODEL, input=inputs[0], encoding_format="float", dimensions=64)
    assert len(floats.data[0].embedding) == 64
    head = vecs[0][:64]
    assert np.allclose(
        floats.data[0].embedding, head / np.linalg.norm(head), atol=1e-5
    )  # renormalised prefix
    raw = post(base_url, "/v1/embeddings", {"input": [[1, 2, 3], [4, 5]], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (EMBEDDING_DIM,) and raw["usage"]["prompt_tokens"] == 5
    assert raw["object"] == "list" and raw["data"][1]["object"] == "embedding"


def test_binary_embeddings_are_raw_values_with_their_offsets_in_a_metadata_header(base_url: str) -> None:
    body = {"input": ["a b c", "d e"], "dimensions": 16}
    floats = post(base_url, "/v1/embeddings", body).json()["data"]
    binary = post(base_url, "/v1/embeddings", {**body, "encoding_format": "bytes", "embed_dtype": "float16",
                                               "endianness": "big"})  # fmt: skip
    assert binary.headers["content-type"] == "application/octet-stream"
    meta = json.loads(binary.headers["metadata"])
    assert meta["usage"]["prompt_tokens"] == meta["usage"]["total_tokens"] > 0
    for item, expected in zip(meta["data"], floats, strict=True):
        assert (item["embed_dtype"], item["endianness"], item["shape"]) == ("float16", "big", [16])
        values = np.frombuffer(binary.content[item["start"] : item["end"]], dtype=">f2")
        assert np.allclose(values, expected["embedding"], atol=1e-3)
    only = post(base_url, "/pooling", {**body, "encoding_format": "bytes_only"})
    assert "metadata" not in only.headers and len(only.content) == 2 * 16 * 4


def test_pooling_classify_score_rerank_shapes(base_url: str) -> None:
    pooled = post(base_url, "/pooling", {"model": MODEL, "input": ["a b c", "d e f"]}).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    assert len(pooled["data"][0]["data"]) == EMBEDDING_DIM
    classes = post(base_url, "/classify", {"input": "classify me"}).json()["data"][0]
    assert classes["num_classes"] == len(classes["probs"]) and math.isclose(
        sum(classes["probs"]), 1.0, rel_tol=1e-6
    )
    assert classes["label"] in ("LABEL_0", "LABEL_1")
    for path in ("/score", "/v1/score"):
        scores = post(base_url, path, {"text_1": "hello world", "text_2": ["hello world", "bye"]}).json()
        assert [d["object"] for d in scores["data"]] == ["score", "score"]
        assert scores["data"][0]["score"] > scores["data"][1]["score"]
    docs = ["goodbye moon", "hello world again", "zzz"]
    for path in ("/rerank", "/v1/rerank"):
        ranked = post(base_url, path, {"query": "hello world", "documents": docs, "top_n": 2}).json()
        assert len(ranked["results"]) == 2 and ranked["results"][0]["index"] == 1
        assert ranked["results"][0]["document"]["text"] == docs[1]
        assert ranked["results"][0]["relevance_score"] >= ranked["results"][1]["relevance_score"]
        assert ranked["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "binary"}, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "bytes", "endianness": "middle"}, "endianness"),
        ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "x" * 70000}, "input"),
        ("/pooling", {"input": [1.5]}, "input"),
        ("/classify", {}, "input"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ],
)
def test_pooling_routes_validate_input(base_url: str, path: str, body: dict[str, Any], param: str) -> None:
    resp = post(base_url, path, body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == param and err["message"]


def test_unknown_model_is_404_on_every_route(base_url: str) -> None:
    for path, body in [
        ("/v1/embeddings", {"input": "x"}),
        ("/pooling", {"input": "x"}),
        ("/classify", {"input": "x"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ]:
        resp = post(base_url, path, {"model": "other", **body})
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError", path


def test_tokenize_and_detokenize(base_url: str) -> None:
    tok = post(base_url, "/tokenize", {"prompt": "héllo", "return_token_strs": True}).json()
    assert tok["count"] == 6 and len(tok["token_strs"]) == 6 and tok["max_model_len"] > 0
    assert post(base_url, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "héllo"
    chat = post(base_url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len("<|user|>\nhi<|end|>\n<|assistant|>\n")


def _wav(seconds: float, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return buf.getvalue()


def test_audio_transcription(client: openai.OpenAI, base_url: str) -> None:
    audio = _wav(2.5)
    first = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio))
    again = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio))
    assert first.text and first.text == again.text  # deterministic
    usage: Any = first.usage
    assert usage is not None and usage.type == "duration" and usage.seconds == 3
    other = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", _wav(1.0)))
    assert other.text != first.text
    text = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), response_format="text")
    assert str(text).strip() == first.text
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="other", file=("clip.wav", audio))
    no_file = httpx.post(f"{base_url}/v1/audio/transcriptions", files={"model": (None, MODEL)}, timeout=5)
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
    not_form = httpx.post(f"{base_url}/v1/audio/transcriptions", json={"model": MODEL}, timeout=5)
    assert not_form.status_code == 400
