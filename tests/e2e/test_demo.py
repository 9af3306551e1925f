"""`kvgate serve --demo`: emulated vLLM workers as children, the OpenAI SDK in front, real prefix
caching through the gateway, and every child gone after SIGTERM."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.harness import Proc, assert_sigterm_stops_the_workers, free_port, start, wait_http
from tests.support.wait import wait_until_sync

KEY = "sk-e2e-demo"


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[str, Proc]]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--demo",
        "--workers",
        "2",
        "--port",
        str(port),
        "--demo-key",
        KEY,
        "--metrics-port",
        "0",
    ]
    proc = start(argv)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=40)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()


def test_demo_prints_url_and_key(demo: tuple[str, Proc]) -> None:
    base, proc = demo
    out = proc.output()
    assert f"base URL: {base}/v1" in out and f"API key:  {KEY}" in out


def test_identical_prefix_is_cached_through_the_gateway(demo: tuple[str, Proc]) -> None:
    base, _ = demo
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30)
    system = {"role": "system", "content": "You answer in one short sentence. " * 20}
    cached = []
    for question in ("What is a KV cache?", "What is prefill?"):
        reply = client.chat.completions.create(
            model="kvgate-demo", messages=[system, {"role": "user", "content": question}], max_tokens=8
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[1] >= 512  # the shared system prompt came from the worker's prefix cache


async def test_async_stream_and_tool_round_trip_on_the_emulator(demo: tuple[str, Proc]) -> None:
    base, _ = demo
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30)
    tools: list[Any] = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
            },
        }
    ]
    messages: list[Any] = [{"role": "user", "content": "look it up"}]
    stream = await client.chat.completions.create(
        model="kvgate-demo",
        messages=messages,
        tools=tools,
        stream=True,
        stream_options={"include_usage": True},
    )
    name, args, call_id, usage = "", "", "", None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call_id += tc.id or ""
            if tc.function is not None:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
    assert name == "lookup" and "q" in json.loads(args) and usage is not None
    messages += [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "found it"},
    ]
    final = await client.chat.completions.create(
        model="kvgate-demo", messages=messages, tools=tools, max_tokens=8
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_the_readme_snippet_runs_against_the_demo(demo: tuple[str, Proc]) -> None:
    base, _ = demo
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S)
    assert snippet is not None and "http://127.0.0.1:8080/v1" in snippet.group(1)
    code = snippet.group(1).replace("http://127.0.0.1:8080/v1", base + "/v1").replace("sk-kvgate-demo", KEY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cached = [int(n) for n in re.findall(r" (\d+)$", out.stdout, re.M)]
    assert len(cached) >= 2 and cached[1] > 0  # the second request's prefix was cached


def test_worker_metrics_are_scraped_into_routing(demo: tuple[str, Proc]) -> None:
    base, proc = demo
    found = re.search(r"metrics (http://127\.0\.0\.1:\d+/metrics)", proc.output())
    assert found is not None  # the metrics listener's address is printed at startup
    assert httpx.get(base + "/metrics", timeout=5).status_code == 404  # never on the client port

    def scraped() -> str | None:
        text = httpx.get(found.group(1), timeout=5).text
        return text if text.count("kvgate_worker_requests_waiting{") == 2 else None

    text = wait_until_sync(scraped, what="both workers' waiting requests are reported")
    assert text.count("kvgate_worker_kv_cache_usage{") == 2


def test_sigterm_stops_every_worker() -> None:
    assert_sigterm_stops_the_workers(("--demo", "--workers", "2"), 2, 40)
