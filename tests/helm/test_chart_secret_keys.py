"""Secret keys the schema used to accept that render a Secret, or a reference to one, the API
server refuses: a key is letters, digits, `-`, `_` and `.`, never `.` or `..` nor starting with `..`."""

from __future__ import annotations

import helm_python
import pytest

from tests.helm.chart import POOL, RELEASE, gateway_config, nested, render, validate_strictly

# Where each key is used: a Secret's data key, a secretKeyRef key or a volume's items key.
SECRET_KEYS = ["sync.auth.tokenKey", "keyHashSecret.key", "tracing.otlp.headersSecret.key"]


@pytest.mark.parametrize("path", SECRET_KEYS)
@pytest.mark.parametrize("bad", ["my token", "a/b", ".", "..", "..hidden", "k" * 254])
def test_a_secret_key_kubernetes_refuses_fails_the_install(path: str, bad: str) -> None:
    """A Secret's keys are letters, digits, `-`, `_` and `.`, never `.` or `..` nor starting with
    `..` (the API server's rule): anything else renders a Secret or a reference it refuses."""
    values = nested(path, bad)
    if path.startswith("tracing"):
        values["tracing"] |= {"enabled": True}
        values["tracing"]["otlp"]["headersSecret"]["name"] = "otlp-headers"
    with pytest.raises(helm_python.HelmError, match="/" + path.replace(".", "/")):
        render(values)


@pytest.mark.parametrize("bad", ["my key", "a/b", ".."])
def test_a_worker_api_key_secret_key_kubernetes_refuses_fails_the_install(bad: str) -> None:
    pool = POOL | {"workerApiKeySecret": {"name": "vllm-api-key", "key": bad}}
    with pytest.raises(helm_python.HelmError, match="/pools/0/workerApiKeySecret/key"):
        render({"pools": [pool]})


def test_secret_keys_kubernetes_takes_still_render() -> None:
    for key in ("token", "nats-token", "sync_token.v2", ".hidden", "K3Y"):
        docs = render(
            {"sync": {"auth": {"tokenKey": key}}, "keyHashSecret": {"existingSecret": "mine", "key": key}}
        )
        assert gateway_config(docs)["sync"]["auth"] == {"token_file": f"/etc/kvgate/sync-token/{key}"}
        assert list(docs[f"Secret/{RELEASE}-kvgate-sync-token"]["data"]) == [key]
        validate_strictly(docs)
    pool = POOL | {"workerApiKeySecret": {"name": "vllm-api-key", "key": "api.key"}}
    render({"pools": [pool]})
