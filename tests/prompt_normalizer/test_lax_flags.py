"""The chat template flags (`add_generation_prompt`, `continue_final_message`,
`add_special_tokens`) are read as vLLM's lax pydantic model reads a boolean: a body the worker
renders is keyed as it renders it, and what the worker refuses is refused."""

from __future__ import annotations

from typing import Any

import pytest

from prompt_normalizer.chat_input import request_flag
from prompt_normalizer.errors import NormalizerError

READS = [("false", False), ("0", False), (0, False), ("no", False), ("True", True), (1, True), ("on", True)]


@pytest.mark.parametrize(("value", "expected"), [*READS, (None, True)])
def test_a_template_flag_reads_as_a_lax_boolean(value: Any, expected: bool) -> None:
    assert request_flag({"add_generation_prompt": value}, "add_generation_prompt", True) is expected


@pytest.mark.parametrize("value", ["maybe", 2, [], " no"])
def test_a_template_flag_lax_mode_refuses_is_an_error(value: Any) -> None:
    with pytest.raises(NormalizerError) as info:
        request_flag({"continue_final_message": value}, "continue_final_message", False)
    assert info.value.param == "continue_final_message"
