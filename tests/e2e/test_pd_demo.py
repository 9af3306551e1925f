"""`kvgate serve --demo --pd 1:1`: one prefill and one decode emulated worker behind the gateway,
in both wire protocols. The README snippet runs against it (the answer, `cached_tokens` > 0 on
the repeated prompt, the stream), the first request is split (its prefill on the prefill worker,
its KV moved, its answer from the decode worker), and SIGTERM stops every child."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.harness import Proc, assert_sigterm_stops_the_workers, free_port, start, wait_http

KEY = "sk-e2e-pd-demo"
README = Path(__file__).resolve().parents[2] / "README.md"


@dataclass(frozen=True)
class Demo:
    base: str
    metrics: str  # the metrics listener's /metrics
    proc: Proc
    protocol: str


def metric(demo: Demo, name: str) -> float:
    """The sum of every series of a gateway counter."""
    text = httpx.get(demo.metrics, timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def demo(request: pytest.FixtureRequest) -> Iterator[Demo]:
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--demo", "--pd", "1:1", "--pd-protocol"]
    argv += [request.param, "--port", str(port), "--metrics-port", str(metrics_port), "--demo-key", KEY]
    proc = start(argv)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=60)
        yield Demo(
            f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", proc, request.param
        )
    finally:
        assert proc.stop() == 0


def test_the_first_request_is_split_and_answered_by_the_decode_worker(demo: Demo) -> None:
    assert "1 prefill + 1 decode emulated workers" in demo.proc.output()
    client = openai.OpenAI(base_url=demo.base + "/v1", api_key=KEY, max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "Explain prefill/decode disaggregation. " * 30}]
    reply = client.chat.completions.create(model="kvgate-demo", messages=messages, max_tokens=8)
    assert reply.choices[0].message.content and reply.usage is not None
    assert reply.usage.completion_tokens == 8
    # The client sees the prefill worker's hit (none yet), not the KV the decode worker received.
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(demo, "kvgate_pd_transfers_total") >= 1
    assert 'kvgate_pd_requests_total{pool="demo",role="prefill"}' in httpx.get(demo.metrics).text
    # A stream's decode leg has a first token: the transfer is timed (a whole answer's is not).
    messages = [{"role": "user", "content": "Now stream about KV transfers. " * 30}]
    chunks = client.chat.completions.create(model="kvgate-demo", messages=messages, max_tokens=4, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert metric(demo, "kvgate_pd_transfer_seconds_count") >= 1
    assert metric(demo, "kvgate_pd_transfer_outcomes_total") >= 2


def _served_by(demo: Demo, role: str) -> float:
    series = f'kvgate_pd_requests_total{{pool="demo",role="{role}"}}'
    lines = httpx.get(demo.metrics, timeout=5).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series))


def test_a_responses_request_runs_alone_with_vllm_and_split_with_sglang(demo: Demo) -> None:
    # vLLM's prefill leg caps `max_tokens`, not Responses' `max_output_tokens`, and its Responses
    # route moves no KV; SGLang's prefill leg computes the prompt whatever the route.
    prefills, alone = _served_by(demo, "prefill"), _served_by(demo, "alone")
    client = openai.OpenAI(base_url=demo.base + "/v1", api_key=KEY, max_retries=0, timeout=30)
    reply = client.responses.create(
        model="kvgate-demo", input="Explain why a Responses request is not split. " * 30, max_output_tokens=8
    )
    assert reply.output_text and reply.usage is not None and reply.usage.output_tokens == 8
    split = demo.protocol == "sglang"
    assert _served_by(demo, "prefill") == prefills + split
    assert _served_by(demo, "alone") == alone + (not split)


def test_the_readme_snippet_runs_against_the_pd_demo(demo: Demo) -> None:
    base = demo.base
    snippet = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert snippet is not None
    code = snippet.group(1).replace("http://127.0.0.1:8080/v1", base + "/v1").replace("sk-kvgate-demo", KEY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    cached = [int(n) for n in re.findall(r" (\d+)$", out.stdout, re.M)]
    assert len(cached) >= 2 and cached[1] > 0  # the repeated prompt's prefix was cached
    assert lines[0].rsplit(" ", 1)[0]  # an answer
    assert len(lines) == 3 and lines[2]  # and the streamed one


def test_sigterm_stops_the_prefill_and_decode_workers() -> None:
    assert_sigterm_stops_the_workers(("--demo", "--pd", "1:1"), 2, 60)


def test_a_bad_pd_flag_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--demo", "--pd", "1:x", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "--pd takes P:D" in out.stderr


@pytest.mark.parametrize("field", ["kv_transfer_params", "bootstrap_room"])
def test_clients_cannot_set_the_transfer_fields(demo: Demo, field: str) -> None:
    client = openai.OpenAI(base_url=demo.base + "/v1", api_key=KEY, max_retries=0, timeout=30)
    value: object = {"do_remote_prefill": True} if field == "kv_transfer_params" else 7
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="kvgate-demo", messages=[{"role": "user", "content": "hi"}], extra_body={field: value}
        )
    assert err.value.body is not None and field in str(err.value.body)


def test_the_holder_prefill_demo_runs_mixed_workers_in_that_mode() -> None:
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--demo", "--pd", "holder_prefill"]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port), "--demo-key", KEY]
    proc = start(argv)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=60)
        assert "2 emulated workers, pd.mode holder_prefill" in proc.output()
        demo = Demo(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", proc, "vllm")
        client = openai.OpenAI(base_url=demo.base + "/v1", api_key=KEY, max_retries=0, timeout=30)
        messages = [{"role": "user", "content": "Explain holder prefill. " * 30}]
        for _ in range(2):
            reply = client.chat.completions.create(model="kvgate-demo", messages=messages, max_tokens=4)
            assert reply.usage is not None and reply.usage.completion_tokens == 4
        # Nobody holds more of the prompt than the policy's pick: both ran alone, the second on
        # the holder of the first, with its prompt cached.
        assert reply.usage.prompt_tokens_details is not None
        assert reply.usage.prompt_tokens_details.cached_tokens > 0
        assert metric(demo, "kvgate_pd_skipped_splits_total") == 2
        assert (
            'kvgate_pd_skipped_splits_total{pool="demo",reason="policy"} 2.0' in httpx.get(demo.metrics).text
        )
    finally:
        assert proc.stop() == 0


def test_holder_prefill_is_refused_with_sglang() -> None:
    argv = ["serve", "--demo", "--pd", "holder_prefill", "--pd-protocol", "sglang", "--port", "0"]
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "needs --pd-protocol vllm" in out.stderr
