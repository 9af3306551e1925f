"""Request bodies the emulator takes and refuses as vLLM 0.33 does: the response id named after
the `X-Request-Id` header (else the body's `request_id`), content parts without a `type` and
audio and video parts, custom roles, an empty model name, Responses tools that are not functions;
and a sampling field of the wrong type refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.processes import running_emulator

CLIP = {"data": "UklGRg==", "format": "wav"}


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    with running_emulator("--host", "127.0.0.1", "--model", "m") as url:
        yield url


def _post(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + path, json={"model": "m", "max_tokens": 2, **body}, headers=headers, timeout=30)


def _chat(url: str, messages: list[Any], **extra: Any) -> httpx.Response:
    return _post(url, "/v1/chat/completions", {"messages": messages, **extra})


@pytest.mark.parametrize(
    ("path", "body", "prefix"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "chatcmpl"),
        ("/v1/completions", {"prompt": "hi"}, "cmpl"),
    ],
)
def test_the_response_is_named_after_the_request_id_header(
    emulator: str, path: str, body: dict[str, Any], prefix: str
) -> None:
    named = _post(emulator, path, {**body, "request_id": "from-body"}, **{"X-Request-Id": "from-header"})
    assert named.status_code == 200 and named.json()["id"] == f"{prefix}-from-header"
    assert _post(emulator, path, {**body, "request_id": "from-body"}).json()["id"] == f"{prefix}-from-body"
    streamed = _post(emulator, path, {**body, "stream": True}, **{"x-request-id": "s1"})
    assert f'"id":"{prefix}-s1"'.encode() in streamed.content


@pytest.mark.parametrize(
    "content",
    [
        ["hi", "there"],
        [{"image_url": "https://example.invalid/a.png"}, "what is it?"],
        [{"type": "input_audio", "input_audio": CLIP}, {"type": "text", "text": "transcribe"}],
        [{"input_audio": CLIP}],
        [{"type": "audio_url", "audio_url": {"url": "https://example.invalid/a.wav"}}],
        [{"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}}],
        [{"video_url": "https://example.invalid/v.mp4"}],
    ],
    ids=[
        "strings",
        "untyped_image",
        "input_audio",
        "untyped_input_audio",
        "audio_url",
        "video_url",
        "untyped_video",
    ],
)
def test_parts_vllm_takes_are_taken(emulator: str, content: list[Any]) -> None:
    resp = _chat(emulator, [{"role": "user", "content": content}])
    assert resp.status_code == 200, resp.text


def test_media_parts_cost_their_placeholder_and_differ_by_their_data(emulator: str) -> None:
    def prompt_tokens(part: dict[str, Any]) -> int:
        resp = _chat(emulator, [{"role": "user", "content": ["x", part]}])
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["prompt_tokens"])

    image = prompt_tokens({"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}})
    assert prompt_tokens({"image_url": "https://example.invalid/a.png"}) == image
    assert (
        prompt_tokens({"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}}) == image
    )
    assert prompt_tokens({"type": "input_audio", "input_audio": CLIP}) == image


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"text": "no type"}], "messages[0].content[0]"),
        ([{"type": "input_audio", "input_audio": {"format": "wav"}}], "messages[0].content[0]"),
        ([{"type": "video_url"}], "messages[0].content[0]"),
        ([7], "messages[0].content[0]"),
    ],
)
def test_parts_vllm_refuses_are_refused(emulator: str, content: list[Any], param: str) -> None:
    resp = _chat(emulator, [{"role": "user", "content": content}])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_custom_roles_and_an_empty_model_name_are_taken(emulator: str) -> None:
    messages = [{"role": "observation", "content": "sunny"}, {"role": "user", "content": "and?"}]
    assert _chat(emulator, messages).status_code == 200
    resp = _chat(emulator, [{"role": "user", "content": "hi"}], model="")
    assert resp.status_code == 200 and resp.json()["model"] == "m"
    assert _chat(emulator, [{"role": None, "content": "x"}]).json()["error"]["param"] == "messages[0].role"


def test_responses_take_tools_that_are_not_functions(emulator: str) -> None:
    tools = [
        {"type": "web_search_preview"},
        {"type": "function", "name": "f", "parameters": {"type": "object"}},
    ]
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, "tools": tools}
    resp = httpx.post(emulator + "/v1/responses", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    only = {**body, "tools": [{"type": "web_search_preview"}]}
    assert httpx.post(emulator + "/v1/responses", json=only, timeout=30).status_code == 200


SAMPLING_CASES = [
    ("temperature", "hot", 400),
    ("temperature", [1], 400),
    ("top_p", "x", 400),
    ("top_k", 2.5, 400),
    ("seed", 2**64, 400),
    ("temperature", "0.5", 200),
    ("temperature", 1, 200),
    ("temperature", None, 200),
    ("top_k", "3", 200),
    ("seed", -(2**63), 200),
]
# Anthropic's request model has only temperature, top_p and top_k.
ON_MESSAGES = [case for case in SAMPLING_CASES if case[0] in ("temperature", "top_p", "top_k")]


@pytest.mark.parametrize(
    ("path", "field", "value", "status"),
    [
        *(
            (path, *case)
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")
            for case in SAMPLING_CASES
        ),
        *(("/v1/messages", *case) for case in ON_MESSAGES),
    ],
)
def test_sampling_fields_of_the_wrong_type_are_refused(
    emulator: str, path: str, field: str, value: Any, status: int
) -> None:
    prompt: dict[str, Any] = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"prompt": "hi"},
        "/v1/responses": {"input": "hi"},
        "/v1/messages": {"messages": [{"role": "user", "content": "hi"}]},
    }[path]
    resp = _post(emulator, path, {**prompt, field: value})
    assert resp.status_code == status, resp.text
    if status == 400:
        assert field in resp.text


WINDOW = 64


@pytest.fixture(scope="module")
def small_window() -> Iterator[str]:
    with running_emulator("--host", "127.0.0.1", "--model", "m", "--max-model-len", str(WINDOW)) as url:
        yield url


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_budget_up_to_the_window_is_shortened_to_what_the_prompt_leaves(
    small_window: str, field: str
) -> None:
    """vLLM 0.33 refuses only a budget past the window, and shortens one up to it
    (`get_max_tokens`); a prompt that leaves no room is refused."""
    messages = [{"role": "user", "content": "hi"}]
    resp = _post(small_window, "/v1/chat/completions", {"messages": messages, field: WINDOW})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == WINDOW
    assert resp.json()["choices"][0]["finish_reason"] == "length"
    past = _post(small_window, "/v1/chat/completions", {"messages": messages, field: WINDOW + 1})
    assert past.status_code == 400
    error = past.json()["error"]
    assert error["param"] == field
    assert f"{field}={WINDOW + 1} cannot be greater than max_model_len={WINDOW}" in error["message"]
    long = _post(
        small_window, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * WINDOW}]}
    )
    assert long.status_code == 400 and "maximum context length" in long.json()["error"]["message"]
    completions = _post(small_window, "/v1/completions", {"prompt": ["a", "a b c d"], "max_tokens": WINDOW})
    assert completions.status_code == 200, completions.text
    # Each prompt's own budget: the window less that prompt (usage sums both prompts).
    usage = completions.json()["usage"]
    assert usage["completion_tokens"] == 2 * WINDOW - usage["prompt_tokens"]
