"""A policy reload keeps what the gateway learned: after the policy file changes, each session's
next request still goes to the emulated vLLM worker holding its prefix, through a real gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai

from gateway.auth import hash_api_key
from tests.e2e.harness import free_port, start_emulator, start_gateway, tenant, write_gateway_config
from tests.support.gateway_config import SECRET
from tests.support.processes import Proc

ADMIN_KEY = "sk-admin-reload"
SESSIONS = 6


def _cached(client: openai.OpenAI, messages: list[dict[str, str]]) -> int:
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def _reload(base: str) -> dict[str, Any]:
    """Reload the policy file now; the admin API's view of the policy then."""
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    reload = httpx.post(base + "/admin/policy/reload", headers=auth, timeout=30)
    assert reload.status_code == 200, reload.text
    policy: dict[str, Any] = httpx.get(base + "/admin/status", headers=auth, timeout=30).json()["policy"]
    return policy


def _write(path: Path, text: str) -> None:
    """Replace the policy file whole, as docs/policy.md asks (written elsewhere, renamed over it):
    this test is of what a reload keeps, not of a file caught half-written."""
    staged = path.with_suffix(".new")
    staged.write_text(text)
    staged.replace(path)


def _index_keys(policy: dict[str, Any]) -> int:
    return sum(int(ix["keys"]) for ix in policy["stats"]["index"].values())


def test_sessions_stay_with_their_workers_across_a_policy_reload(tmp_path: Path) -> None:
    workers: list[Proc] = []
    gateway = None
    try:
        urls = []
        for _ in range(4):
            url, proc = start_emulator("--model", "m", "--time-scale", "50")
            urls.append(url)
            workers.append(proc)
        policy = tmp_path / "policy.yaml"
        policy.write_text("policy: cost\n")
        config = write_gateway_config(
            tmp_path / "gw.yaml",
            [{"name": "p", "models": ["m"], "workers": urls}],
            [tenant("t", "sk-t")],
            policy_file="policy.yaml",
            admin={"api_key_hash": hash_api_key(SECRET, ADMIN_KEY)},
        )
        port = free_port()
        gateway = start_gateway(config, port)
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="sk-t", max_retries=0, timeout=30)
        histories = [
            [{"role": "system", "content": f"{i} session: " + f"notes of project {i} " * 60}]
            for i in range(SESSIONS)
        ]
        for history in histories:
            history.append({"role": "user", "content": "first question"})
            assert _cached(client, history) == 0
            history.append({"role": "assistant", "content": "x"})

        _write(policy, "policy: cost\nseed: 11\ncost: {epsilon: 0.75}\n")
        assert _reload(base)["policy_file"]["reloads"] == 1

        # Each session's next turn finds its history cached: it went to the worker holding it. A
        # policy that had forgotten them would place each on one of 4 idle workers at random.
        for history in reversed(histories):
            history.append({"role": "user", "content": "second question"})
            assert _cached(client, history) >= 400
        assert _index_keys(_reload(base)) > 0

        # Keyed otherwise (another normalizer), what was learned would match nothing: not kept.
        _write(policy, "policy: cost\nnormalizer: {chars_per_token: 3}\n")
        assert _index_keys(_reload(base)) == 0
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in workers:
            proc.stop()
