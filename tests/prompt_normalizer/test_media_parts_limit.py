"""A request carries at most `MAX_MEDIA_PARTS` content parts that are not text, across all its
messages and on every API keyed as chat; past it the normalizer refuses it with
`array_above_max_length` (a 400 at the gateway), and requests within it, however many text parts
they carry, are keyed as before."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from prompt_normalizer.canonical import canonicalize_chat
from prompt_normalizer.chat_input import MAX_MEDIA_PARTS
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import keyed_digest, secret_key
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity

SECRET = b"media-parts-secret"
IDENTITY = KeyIdentity("m", namespace="tenant-a")


def _image(i: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"https://example.invalid/{i}.png"}}


def _chat(*contents: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(c)} for c in contents]}


def _normalizer() -> Normalizer:
    return Normalizer(NormalizerConfig(), SECRET)


def test_the_limit_is_four_times_openais_images_per_request() -> None:
    assert MAX_MEDIA_PARTS == 2048


def test_one_part_past_the_limit_across_messages_is_refused() -> None:
    first = [_image(i) for i in range(1024)]
    second = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}] * 1025
    with pytest.raises(NormalizerError) as caught:
        _normalizer().canonicalize("chat", _chat(first, second), IDENTITY)
    assert caught.value.code == "array_above_max_length"
    assert caught.value.param == "messages"
    assert "2049 content parts that are not text" in caught.value.message
    assert "at most 2048" in caught.value.message


def test_a_responses_request_is_counted_as_the_chat_it_becomes() -> None:
    images = [{"type": "input_image", "image_url": f"https://example.invalid/{i}.png"} for i in range(2049)]
    body = {"model": "m", "input": [{"role": "user", "content": images}]}
    with pytest.raises(NormalizerError) as caught:
        _normalizer().canonicalize("responses", body, IDENTITY)
    assert caught.value.code == "array_above_max_length"
    assert caught.value.param == "input"  # the client's field, not the chat it becomes
    # A bad part is named by its path in the client's own body too.
    body = {"model": "m", "instructions": "be brief", "input": [{"role": "user", "content": [{"text": "x"}]}]}
    with pytest.raises(NormalizerError) as caught:
        _normalizer().canonicalize("responses", body, IDENTITY)
    assert caught.value.param == "input[0].content[0]"


def test_requests_within_the_limit_are_keyed() -> None:
    # Every part may be an image, and text parts do not count: 2,048 images, each with a caption,
    # and 10,000 more text parts.
    captioned = [
        p for i in range(MAX_MEDIA_PARTS) for p in (_image(i), {"type": "text", "text": f"page {i}"})
    ]
    texts = [{"type": "text", "text": "x"} for _ in range(10_000)]
    prompt = _normalizer().canonicalize("chat", _chat(captioned, texts), IDENTITY)
    assert prompt.n_tokens > 0 and prompt.block_keys


def test_each_images_digest_is_folded_into_the_keys_in_order() -> None:
    """A message's media digests are joined once per message: the keys still follow every image
    and their order, and equal the keys of the same digests folded one by one."""
    normalizer = _normalizer()
    images = [_image(i) for i in range(300)]
    text = [{"type": "text", "text": "describe these " * 40}]
    keys = normalizer.canonicalize("chat", _chat(text + images), IDENTITY).block_keys
    changed = [*images[:299], _image(1000)]
    swapped = [images[1], images[0], *images[2:]]
    assert normalizer.canonicalize("chat", _chat(text + changed), IDENTITY).block_keys[0] != keys[0]
    assert normalizer.canonicalize("chat", _chat(text + swapped), IDENTITY).block_keys[0] != keys[0]
    assert normalizer.canonicalize("chat", _chat(text + images), IDENTITY).block_keys == keys
    key = secret_key(SECRET)
    joined = b"".join(
        keyed_digest(key, orjson.dumps(p, option=orjson.OPT_SORT_KEYS), b"kvgate-media") for p in images
    )
    chat = canonicalize_chat(_chat(text + images), NormalizerConfig(), key)
    assert [(m.message_index, m.digest) for m in chat.media] == [(0, joined)]


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "text"}, "messages[1].content[2].text"),
        ({"text": "no type"}, "messages[1].content[2]"),
        (42, "messages[1].content[2]"),
    ],
)
def test_a_bad_part_is_still_named_by_its_path(part: Any, param: str) -> None:
    body = _chat([{"type": "text", "text": "a"}], [_image(0), {"type": "text", "text": "b"}, part])
    with pytest.raises(NormalizerError) as caught:
        _normalizer().canonicalize("chat", body, IDENTITY)
    assert caught.value.param == param
