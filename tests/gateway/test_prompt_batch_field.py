"""A batch's 400 names the field that holds the batch (`prompt_batch.check_sequences`), which is
the field it was counted in, not the first prompt field the body has."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.bodies import parse_body
from gateway.errors import ApiError
from gateway.routes import ROUTES


def _refusal(body: dict[str, Any], path: str) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_body(orjson.dumps(body), ROUTES[path], max_choices=128)
    return err.value


@pytest.mark.parametrize("path", ["/generate", "/inference/v1/generate"])
@pytest.mark.parametrize("text", [5, "one prompt", [], None])
def test_a_batch_in_input_ids_is_named_as_input_ids(path: str, text: object) -> None:
    err = _refusal({"model": "m", "text": text, "input_ids": [[1]] * 200}, path)
    assert (err.status, err.code, err.param) == (400, "integer_above_max_value", "input_ids")
    assert err.message.startswith("'input_ids' is a batch of 200 prompts with 1 choices each")


def test_a_batch_in_token_ids_is_named_as_token_ids() -> None:
    err = _refusal({"model": "m", "input_ids": None, "token_ids": [[1]] * 200}, "/generate")
    assert err.param == "token_ids" and "'token_ids' is a batch of 200" in err.message
