"""`pd.mode: holder_prefill` over HTTP: two mixed emulated vLLM workers behind a real gateway
routing with `cost`. A conversation runs where `cost` sends it while its worker is free; when
that worker is busy decoding a long answer and `cost`'s bounded-load guard sends the next turn
to the other worker, the holder prefills the turn from its cache and the other worker receives
the KV and answers, instead of computing the whole prompt again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Proc, free_port, start_emulator, start_gateway, tenant, write_gateway_config
from tests.e2e.test_pd_failures import KEY, PdStack, _wait_routable

MODEL = "m-holder"
# A guard that admits no worker above the mean, so one stream in flight turns the next turn away.
POLICY = "policy: cost\ncost:\n  epsilon: 0\n  slack_requests: 0\n"
HISTORY = [{"role": "system", "content": "You review pull requests with care. " * 300}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdStack]:
    procs: dict[str, Proc] = {}
    urls: dict[str, str] = {}
    gateway: Proc | None = None
    try:
        for name in ("w0", "w1"):
            urls[name], procs[name] = start_emulator("--host", "127.0.0.1", "--model", MODEL)
        folder = Path(tmp_path_factory.mktemp("holder"))
        (folder / "policy.yaml").write_text(POLICY)
        pool = {
            "name": "hp",
            "models": [MODEL],
            "workers": [urls["w0"], urls["w1"]],
            "pd": {"protocol": "vllm", "mode": "holder_prefill"},
            "health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3},
        }
        config = write_gateway_config(
            folder / "gateway.yaml", [pool], [tenant("t", KEY)], policy_file="policy.yaml"
        )
        port, metrics_port = free_port(), free_port()
        gateway = start_gateway(config, port, metrics_port)
        stack = PdStack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", procs, urls)
        _wait_routable(stack, {"hp": 2})
        yield stack
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs.values():
            proc.stop()


def _turn(text: str) -> list[dict[str, str]]:
    return [*HISTORY, {"role": "user", "content": text}]


def test_a_turn_sent_off_its_busy_holder_is_prefilled_there_and_answered_elsewhere(stack: PdStack) -> None:
    client = stack.client()
    first = client.chat.completions.create(
        model=MODEL, messages=_turn("Review the first file."), max_tokens=4
    )
    assert first.usage is not None and first.usage.completion_tokens == 4
    # With its worker free, the next turn runs there alone and finds the history cached.
    alone = stack.counter("kvgate_pd_requests_total", pool="hp", role="alone")
    second = client.chat.completions.create(model=MODEL, messages=_turn("And the second?"), max_tokens=4)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert stack.counter("kvgate_pd_requests_total", pool="hp", role="alone") == alone + 1
    assert stack.counter("kvgate_pd_skipped_splits_total", pool="hp", reason="policy") >= 2
    assert stack.counter("kvgate_pd_requests_total", pool="hp", role="prefill") == 0

    # A long answer keeps the holder busy while the next turn arrives.
    stream = client.chat.completions.create(
        model=MODEL, messages=_turn("Now write the full review."), max_tokens=4000, stream=True
    )
    try:
        assert any(c.choices and c.choices[0].delta.content for c in stream)
        third = client.chat.completions.create(model=MODEL, messages=_turn("And the third?"), max_tokens=4)
    finally:
        stream.close()
    assert third.choices[0].message.content and third.usage is not None
    assert third.usage.completion_tokens == 4
    # The holder prefilled it from its cache (the client sees the prefill leg's hit), and the
    # other worker received the KV and decoded.
    assert third.usage.prompt_tokens_details is not None
    assert third.usage.prompt_tokens_details.cached_tokens > 0
    assert stack.counter("kvgate_pd_requests_total", pool="hp", role="prefill") == 1
    assert stack.counter("kvgate_pd_requests_total", pool="hp", role="decode") == 1
    assert stack.counter("kvgate_pd_transfer_outcomes_total", pool="hp", outcome="ok") == 1
