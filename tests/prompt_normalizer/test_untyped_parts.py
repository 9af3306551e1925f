"""Content parts sent without a `type`, as vLLM takes them: a string part is a text part (keyed as
the same text sent as `{"type": "text"}`, which vLLM renders alike), and a part naming its media
(`{"image_url": "https://..."}`, `audio_url`, `video_url`, `input_audio`) is that media part,
counted against `MAX_MEDIA_PARTS`. String parts are bounded too (`MAX_STRING_PARTS`); a part
that is neither is still refused, named by its path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prompt_normalizer.canonical import canonicalize_chat
from prompt_normalizer.chat_input import MAX_MEDIA_PARTS, MAX_STRING_PARTS
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import secret_key
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.template import ChatTemplateTokenizer
from prompt_normalizer.types import KeyIdentity

SECRET = b"untyped-parts-secret"
IDENTITY = KeyIdentity("m", namespace="tenant-a", block_size_tokens=4)
TEXT = "Describe what you see in the picture below, please. " * 4
URL = "https://example.invalid/cat.png"


def _chat(*contents: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


def _keys(body: dict[str, Any], config: NormalizerConfig | None = None) -> tuple[int, ...]:
    return Normalizer(config or NormalizerConfig(), SECRET).canonicalize("chat", body, IDENTITY).block_keys


def test_a_string_part_keys_as_the_same_text_part() -> None:
    as_string = _chat([TEXT, "and tell me its colour"])
    as_parts = _chat([{"type": "text", "text": TEXT}, {"type": "text", "text": "and tell me its colour"}])
    keys = _keys(as_string)
    assert keys and keys == _keys(as_parts)
    # The text counts: another text keys apart.
    assert _keys(_chat([TEXT.upper(), "and tell me its colour"])) != keys


def test_a_string_part_is_forwarded_as_sent_unless_a_switch_edits_it() -> None:
    """vLLM renders a string part as the text part it becomes here, so the worker may get either:
    the body as sent when nothing else changed, the edited text parts when a switch did."""
    normalizer = Normalizer(NormalizerConfig(), SECRET)
    body = _chat([TEXT])
    assert normalizer.canonicalize("chat", body, IDENTITY).canonical_body is None
    assert body["messages"][0]["content"] == [TEXT]  # the caller's body is left as sent
    spaced = Normalizer(NormalizerConfig(whitespace=True), SECRET)
    rewritten = spaced.canonicalize("chat", _chat([TEXT + "   \n\n\n"]), IDENTITY).canonical_body
    assert rewritten is not None
    part = rewritten["messages"][0]["content"][0]
    assert part["type"] == "text" and part["text"].startswith(TEXT.rstrip())


@pytest.mark.parametrize(
    "part",
    [
        {"image_url": URL},
        {"image_url": {"url": URL}, "uuid": "cat-1"},
        {"audio_url": "https://example.invalid/a.wav"},
        {"video_url": {"url": "https://example.invalid/v.mp4"}},
        {"input_audio": {"data": "AAAA", "format": "wav"}},
    ],
    ids=["image_url", "image_url_uuid", "audio_url", "video_url", "input_audio"],
)
def test_a_part_naming_its_media_is_that_media_part(part: dict[str, Any]) -> None:
    text = {"type": "text", "text": TEXT}
    keys = _keys(_chat([text, part]))
    assert keys
    # Keyed by its digest, like any media part: other media keys apart.
    other = {name: (f"{value}-2" if isinstance(value, str) else value) for name, value in part.items()}
    if other == part:
        other = {**part, "uuid": "another"}
    assert _keys(_chat([text, other])) != keys
    chat = canonicalize_chat(_chat([text, part]), NormalizerConfig(), secret_key(SECRET))
    assert [m.message_index for m in chat.media] == [0]


def test_parts_naming_their_media_count_against_the_media_limit() -> None:
    images = [{"image_url": f"https://example.invalid/{i}.png"} for i in range(MAX_MEDIA_PARTS)]
    assert _keys(_chat(images[:-1], [{"type": "text", "text": "which?"}, images[-1]]))
    with pytest.raises(NormalizerError) as caught:
        _keys(_chat(images, [{"video_url": "https://example.invalid/v.mp4"}]))
    assert caught.value.code == "array_above_max_length"
    assert f"{MAX_MEDIA_PARTS + 1} content parts that are not text" in caught.value.message


def test_string_parts_are_bounded() -> None:
    half = MAX_STRING_PARTS // 2
    assert _keys(_chat(["a"] * half, ["b"] * (MAX_STRING_PARTS - half)))
    with pytest.raises(NormalizerError) as caught:
        _keys(_chat(["a"] * half, ["b"] * (MAX_STRING_PARTS - half + 1)))
    assert caught.value.code == "array_above_max_length"
    assert caught.value.param == "messages"
    assert f"more than {MAX_STRING_PARTS} content parts sent as strings" in caught.value.message


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"text": "no type"}, "messages[0].content[1]"),
        ({"type": None, "detail": "low"}, "messages[0].content[1]"),
        (42, "messages[0].content[1]"),
        (None, "messages[0].content[1]"),
        ({"type": "text"}, "messages[0].content[1].text"),
    ],
)
def test_a_part_that_is_neither_is_refused(part: Any, param: str) -> None:
    with pytest.raises(NormalizerError) as caught:
        _keys(_chat(["fine", part]))
    assert caught.value.code == "invalid_prompt"
    assert caught.value.param == param


def test_the_template_sees_a_part_naming_its_media_as_the_typed_part(tiny_model_dir: Path) -> None:
    """In an "openai"-format template a media part is `{"type": <modality>}`, as vLLM gives it:
    the same for a part with a type and one naming its media."""
    tokenizer = ChatTemplateTokenizer(str(tiny_model_dir), content_format="openai")
    key = secret_key(SECRET)

    def rendered(*parts: Any) -> str:
        return tokenizer.render(canonicalize_chat(_chat(list(parts)), NormalizerConfig(), key))

    typed = rendered("look:", {"type": "image_url", "image_url": {"url": URL}})
    assert "'image'" in typed
    assert rendered("look:", {"image_url": URL}) == typed
    assert rendered({"type": "text", "text": "look:"}, {"image_url": {"url": URL}, "uuid": "u"}) == typed
    video = rendered("see:", {"type": "video_url", "video_url": {"url": URL}})
    assert "'video'" in video
    assert rendered("see:", {"video_url": URL}) == video


def test_the_template_sees_input_audio_as_audio(tiny_model_dir: Path) -> None:
    """vLLM gives an `input_audio` part to an "openai"-format template as `{"type": "audio"}`, as
    it does an `audio_url` part (a template looking for audio must find it), not `"input"`."""
    tokenizer = ChatTemplateTokenizer(str(tiny_model_dir), content_format="openai")
    key = secret_key(SECRET)
    clip = {"data": "AAAA", "format": "wav"}

    def rendered(part: dict[str, Any]) -> str:
        return tokenizer.render(canonicalize_chat(_chat(["hear:", part]), NormalizerConfig(), key))

    audio = rendered({"type": "audio_url", "audio_url": {"url": "https://example.invalid/a.wav"}})
    assert "'audio'" in audio
    assert rendered({"type": "input_audio", "input_audio": clip}) == audio
    assert rendered({"input_audio": clip}) == audio
    assert "'image'" in rendered({"type": "input_image", "image_url": URL})
