"""A pool cannot forward vLLM's `X-Vllm-Priority`: vLLM 0.33 reads it in place of the body's
`priority`, which the gateway sets to the tenant's `engine_priority`."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.upstream_headers import forwardable_name


def _config(forward_headers: list[str]) -> dict[str, Any]:
    pool = {"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}
    pool["forward_headers"] = forward_headers
    return {"pools": [pool], "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}]}


@pytest.mark.parametrize("name", ["X-Vllm-Priority", "x-vllm-priority", " X-VLLM-PRIORITY "])
def test_the_priority_header_is_refused_naming_it_and_why(name: str) -> None:
    reason = "engine-internal header: vLLM reads it in place of the body field priority"
    with pytest.raises(ValueError, match=f"'x-vllm-priority' can never be forwarded .*{reason}"):
        forwardable_name(name)
    refused = r"pools\.0\.forward_headers.*'x-vllm-priority' can never be forwarded .*engine_priority"
    with pytest.raises(ConfigError, match=refused):
        parse_config(_config(["traceparent", name]))


def test_names_that_only_look_alike_may_be_forwarded() -> None:
    assert forwardable_name("x-vllm-priority-hint") == "x-vllm-priority-hint"
    assert parse_config(_config(["x-my-vllm-priority"])).pools[0].forward_headers == ["x-my-vllm-priority"]
