"""Failures in prefill/decode pools lose nothing: real emulated prefill and decode workers (and a
fake prefill worker that answers 500) behind a real gateway.

- pool `pfail` (vLLM): a failing prefill worker beside a good one; the request is prefilled on the
  good one. Its decode worker is killed mid-stream by the last test.
- pool `xfail` (vLLM): the prefill worker advertises an address nobody listens on, so every
  transfer fails; the request is recomputed on the decode worker alone.
- pool `sgl` (SGLang): a failing prefill worker (whose bootstrap port is closed) beside a good one.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.harness import (
    Proc,
    free_port,
    start_emulator,
    start_fake_workers,
    start_gateway,
    tenant,
    write_gateway_config,
)
from tests.support.metrics import text_total
from tests.support.wait import wait_until_sync

KEY = "sk-e2e-pd"


@dataclass
class PdStack:
    base_url: str
    metrics_url: str
    emulators: dict[str, Proc]
    urls: dict[str, str]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=KEY, max_retries=0, timeout=30)

    def counter(self, name: str, **labels: str) -> float:
        """A gateway counter summed over the series whose labels include `labels`."""
        return text_total(httpx.get(self.metrics_url, timeout=5).text, name, **labels)


def _emulator(model: str, *args: str) -> tuple[str, Proc]:
    return start_emulator("--host", "127.0.0.1", "--model", model, "--time-scale", "10", *args)


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdStack]:
    fake_ports = [free_port(), free_port()]
    procs: dict[str, Proc] = {"fake": start_fake_workers(dict.fromkeys(fake_ports, "error500"))}
    urls = {f"fake{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(fake_ports)}
    gateway: Proc | None = None
    try:
        boot = free_port()
        specs = {
            "p1": ("m-pfail", "--role", "prefill"),
            "d1": ("m-pfail", "--role", "decode"),
            # Decode workers pull the KV from this address, where nothing listens.
            "p2": ("m-xfail", "--role", "prefill", "--kv-advertise-host", "127.0.0.2"),
            "d2": ("m-xfail", "--role", "decode"),
            "p3": ("m-sgl", "--role", "prefill", "--bootstrap-port", str(boot)),
            "d3": ("m-sgl", "--role", "decode", "--pd-protocol", "sglang"),
        }
        for name, (model, *args) in specs.items():
            urls[name], procs[name] = _emulator(model, *args)
        fast = {"health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3}}
        pools = [
            {
                "name": "pfail",
                "models": ["m-pfail"],
                "prefill_workers": [urls["fake0"], urls["p1"]],
                "decode_workers": [urls["d1"]],
                "pd": {"protocol": "vllm"},
                **fast,
            },
            {
                "name": "xfail",
                "models": ["m-xfail"],
                "prefill_workers": [urls["p2"]],
                "decode_workers": [urls["d2"]],
                "pd": {"protocol": "vllm"},
                **fast,
            },
            {
                "name": "sgl",
                "models": ["m-sgl"],
                "prefill_workers": [urls["fake1"], urls["p3"]],
                "decode_workers": [urls["d3"]],
                # The fake prefill worker's bootstrap port is the default, where nothing listens.
                "pd": {
                    "protocol": "sglang",
                    "bootstrap_port": free_port(),
                    "bootstrap_ports": {urls["p3"]: boot},
                },
                **fast,
            },
        ]
        config = write_gateway_config(
            Path(tmp_path_factory.mktemp("pd")) / "gateway.yaml", pools, [tenant("t", KEY)]
        )
        port, metrics_port = free_port(), free_port()
        gateway = start_gateway(config, port, metrics_port)
        stack = PdStack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", procs, urls)
        _wait_routable(stack, {"pfail": 3, "xfail": 2, "sgl": 3})
        yield stack
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs.values():
            proc.stop()


def _wait_routable(stack: PdStack, pools: dict[str, int]) -> None:
    """Wait until each pool has that many healthy workers (gateway metrics)."""

    def routable() -> bool:
        text = httpx.get(stack.metrics_url, timeout=5).text
        return all(
            len(re.findall(rf'kvgate_worker_healthy{{pool="{pool}",[^}}]*}} 1\.0', text)) >= n
            for pool, n in pools.items()
        )

    wait_until_sync(routable, timeout_s=60, what=f"routable workers {pools}")


def _prompt(i: int) -> list[dict[str, str]]:
    # A distinct, long prompt each time: nothing of it is cached anywhere, so it is split.
    return [{"role": "user", "content": f"Request number {i}. " + "Tell me about disaggregation. " * 40}]


def _served_despite_failing_prefill_worker(stack: PdStack, model: str, pool: str, fake: str) -> None:
    client = stack.client()
    for i in range(20):
        reply = client.chat.completions.create(model=model, messages=_prompt(i), max_tokens=4)
        assert reply.choices[0].message.content and reply.usage is not None
        assert reply.usage.completion_tokens == 4
        if stack.counter("kvgate_upstream_retries_total", pool=pool) >= 1:
            break
    assert stack.counter("kvgate_upstream_retries_total", pool=pool) >= 1
    # The failing worker was sent a prefill leg, and every request's answer came from the decode worker.
    sent = httpx.get(stack.urls[fake] + "/_log", timeout=5).json()["requests"]
    assert sent and all(r["body"]["stream"] is False for r in sent)
    assert stack.counter("kvgate_pd_requests_total", pool=pool, role="decode") >= i + 1
    # Per role: a leg's failure (SGLang: the prefill leg's, or the decode leg's that waited for it),
    # and every served prefill leg's time to first token.
    assert stack.counter("kvgate_pd_leg_failures_total", pool=pool) >= 1
    served = stack.counter("kvgate_pd_time_to_first_token_seconds_count", pool=pool, role="prefill")
    assert served >= i + 1
    assert stack.counter("kvgate_pd_transfer_outcomes_total", pool=pool, outcome="ok") >= i + 1


def test_a_failing_prefill_worker_is_replaced_by_another_vllm(pd: PdStack) -> None:
    _served_despite_failing_prefill_worker(pd, "m-pfail", "pfail", "fake0")
    failures = pd.counter("kvgate_pd_leg_failures_total", pool="pfail", role="prefill", reason="worker_error")
    assert failures >= 1 and pd.counter("kvgate_pd_leg_failures_total", pool="pfail", role="decode") == 0
    sent = httpx.get(pd.urls["fake0"] + "/_log", timeout=5).json()["requests"]
    leg = sent[0]["body"]
    assert leg["max_tokens"] == 1 and leg["kv_transfer_params"]["do_remote_decode"] is True


def test_a_failing_prefill_worker_is_replaced_by_another_sglang(pd: PdStack) -> None:
    _served_despite_failing_prefill_worker(pd, "m-sgl", "sgl", "fake1")
    leg = httpx.get(pd.urls["fake1"] + "/_log", timeout=5).json()["requests"][0]["body"]
    assert leg["bootstrap_host"] == "127.0.0.1" and isinstance(leg["bootstrap_room"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_transfer_is_recomputed_on_the_decode_worker(pd: PdStack, stream: bool) -> None:
    client = pd.client()
    failures = pd.counter("kvgate_pd_transfer_failures_total", pool="xfail")
    recomputed = pd.counter("kvgate_pd_transfer_outcomes_total", pool="xfail", outcome="recomputed")
    messages = _prompt(100 + stream)
    if stream:
        chunks = client.chat.completions.create(
            model="m-xfail",
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in chunks:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        assert len(text) == 6 and usage is not None and usage.completion_tokens == 6
    else:
        reply = client.chat.completions.create(model="m-xfail", messages=messages, max_tokens=6)
        assert reply.choices[0].message.content and reply.usage is not None
    assert (
        pd.counter("kvgate_pd_transfer_failures_total", pool="xfail", reason="decode_error") == failures + 1
    )
    assert pd.counter("kvgate_pd_skipped_splits_total", pool="xfail", reason="transfer_failed") >= 1
    outcomes = {o: pd.counter("kvgate_pd_transfer_outcomes_total", pool="xfail", outcome=o) for o in ("ok",)}
    assert outcomes == {"ok": 0}  # every transfer of this pool fails
    assert (
        pd.counter("kvgate_pd_transfer_outcomes_total", pool="xfail", outcome="recomputed") == recomputed + 1
    )
    assert pd.counter("kvgate_pd_leg_failures_total", pool="xfail", role="decode") >= 1
    decode_metrics = httpx.get(pd.urls["d2"] + "/metrics", timeout=5).text
    assert re.search(r"^vllm:nixl_num_failed_transfers\{[^}]*\} [1-9]", decode_metrics, re.M)


def test_a_decode_worker_dying_mid_stream_ends_the_stream_with_an_error_event(pd: PdStack) -> None:
    # Last in this module: it kills pool pfail's only decode worker.
    client = pd.client()
    stream = client.chat.completions.create(
        model="m-pfail", messages=_prompt(200), max_tokens=4000, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices
    pd.emulators["d1"].stop(signal.SIGKILL)
    with pytest.raises(openai.APIError, match="worker stream failed"):
        for _ in chunks:
            pass
