"""Native generate prompts (SGLang's `/generate`, vLLM's `/inference/v1/generate`) keyed as the
same completions prompt, in every mode; errors name the client's field."""

from __future__ import annotations

from typing import Any

import pytest

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import public_identity_of
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity

IDENT = KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4)
PUBLIC = public_identity_of(IDENT)
TEXT = "Summarize the following report in two sentences. " * 6
IDS = list(range(1, 90))


def _norm(**config: Any) -> Normalizer:
    return Normalizer(NormalizerConfig(**config), b"secret")


@pytest.mark.parametrize(
    ("body", "prompt"),
    [
        ({"text": TEXT, "sampling_params": {"max_new_tokens": 4}}, TEXT),
        ({"text": [TEXT, "second"]}, [TEXT, "second"]),
        ({"input_ids": IDS, "stream": True}, IDS),
        ({"input_ids": [IDS, [7, 8]]}, [IDS, [7, 8]]),
        ({"token_ids": IDS, "sampling_params": {"max_tokens": 4}}, IDS),
    ],
)
def test_generate_keys_equal_the_same_completions_prompt(body: dict[str, Any], prompt: Any) -> None:
    norm = _norm()
    native = norm.canonicalize("generate", body, IDENT, PUBLIC)
    completions = norm.canonicalize("completions", {"prompt": prompt}, IDENT, PUBLIC)
    assert native.block_keys and native.block_keys == completions.block_keys
    assert native.n_tokens == completions.n_tokens
    assert native.public_block_keys == completions.public_block_keys
    assert native.canonical_body is None  # forwarded as sent


def test_render_mode_keys_native_text_by_characters_and_token_ids_exactly() -> None:
    norm = _norm(mode="render")
    with pytest.raises(NormalizerError) as info:
        norm.prepare_render("generate", {"text": TEXT})
    assert info.value.code == "render_empty"  # the gateway then calls canonicalize
    by_text = norm.canonicalize("generate", {"text": TEXT}, IDENT)
    assert by_text.block_keys == _norm().canonicalize("generate", {"text": TEXT}, IDENT).block_keys
    by_ids = norm.canonicalize("generate", {"input_ids": IDS}, IDENT)
    assert by_ids.block_keys == norm.canonicalize("completions", {"prompt": IDS}, IDENT).block_keys


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {}}, "text"),
        ({"input_ids": [1.5]}, "input_ids"),
        ({"token_ids": "x" * 10}, "token_ids"),
    ],
)
def test_a_bad_native_prompt_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(NormalizerError) as info:
        _norm(max_input_chars=5).canonicalize("generate", body, IDENT)
    assert info.value.param == param
