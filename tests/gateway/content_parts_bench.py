"""How long the event loop is held by a chat body of very many content parts or messages, within
the size the gateway keys on its loop (`gateway.keying.INLINE_PROMPT_BYTES`).

    python -m tests.gateway.content_parts_bench --repeats 9                      # in process
    python -m tests.gateway.content_parts_bench --gateway-root ROOT --seconds 4   # a real gateway

In process, each shape's body goes through the synchronous work admission does for it on the loop
(`parse_body`, `encode_body`, then the approximate-mode `Normalizer.canonicalize`): printed is the
median process CPU time of `--repeats` runs in ms, and whether the body was keyed or refused (400).
Compare two trees by running it with each on `PYTHONPATH`, interleaved. With `--gateway-root`, each
body is posted to a real gateway from that checkout behind a static worker, back to back for
`--seconds`, while a prober sends `GET /health` every 10 ms (`loadtest.bench_loop_stall`'s stack
and prober); printed is each shape's slowest probe, the statuses and the median request time.
Every body is just under 256 KiB.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

SEED = 0  # the bodies are fixed; kept for the benchmark convention
# Just under the inline bound (256 KiB), with room for the model and `max_tokens`.
BODY_BYTES = 256 * 1024 - 512

Part = Callable[[int], dict[str, Any]]


def _one_message(make: Part, n: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [make(i) for i in range(n)]}]}


def _many_messages(make: Part, n: int) -> dict[str, Any]:
    return {"messages": [make(i) for i in range(n)]}


def _capped_images(make: Part, n: int) -> dict[str, Any]:
    images = [
        {"type": "image_url", "image_url": {"url": f"https://example.invalid/{i}.png"}} for i in range(2048)
    ]
    return {"messages": [{"role": "user", "content": images + [make(i) for i in range(n)]}]}


SHAPES: dict[str, tuple[Part, Callable[[Part, int], dict[str, Any]]]] = {
    # one message of data-URL image parts
    "image_parts": (
        lambda i: {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        _one_message,
    ),
    # one message of the smallest parts that are not text
    "tiny_typed_parts": (lambda i: {"type": "x"}, _one_message),
    # one message of empty text parts
    "text_parts": (lambda i: {"type": "text", "text": ""}, _one_message),
    # many short messages
    "messages": (lambda i: {"role": "user", "content": "x"}, _many_messages),
    # many messages of one text part each
    "part_messages": (lambda i: {"role": "user", "content": [{"type": "text", "text": "x"}]}, _many_messages),
    # many assistant tool calls (canonical JSON rewrites their arguments)
    "tool_calls": (
        lambda i: {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        _many_messages,
    ),
    # 2,048 images (the most a request may carry) and text parts for the rest of the body
    "capped_images_and_text": (lambda i: {"type": "text", "text": ""}, _capped_images),
}


def body_of(shape: str) -> dict[str, Any]:
    """The shape's chat body with as many items as fit in `BODY_BYTES` (encoded)."""
    make, wrap = SHAPES[shape]
    lo, hi = 1, 200_000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(orjson.dumps({"model": "m", "max_tokens": 1, **wrap(make, mid)})) <= BODY_BYTES:
            lo = mid
        else:
            hi = mid - 1
    return wrap(make, lo)


def in_process(shapes: list[str], repeats: int) -> dict[str, dict[str, Any]]:
    """Median ms of admission's synchronous work on each shape's body, in this process."""
    from gateway.bodies import encode_body, parse_body
    from gateway.routes import ROUTES
    from prompt_normalizer.errors import NormalizerError
    from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
    from prompt_normalizer.types import KeyIdentity

    api = ROUTES["/v1/chat/completions"]
    normalizer = Normalizer(NormalizerConfig(), b"content-parts-bench")
    identity = KeyIdentity("m", namespace="bench")
    out: dict[str, dict[str, Any]] = {}
    for shape in shapes:
        raw = orjson.dumps({"model": "m", "max_tokens": 1, **body_of(shape)})
        took: list[float] = []
        outcome = ""
        for _ in range(repeats):
            started = time.process_time()
            try:
                body = parse_body(raw, api)
                encode_body(body)
                prompt = normalizer.canonicalize("chat", body, identity, None)
                outcome = f"keyed, {len(prompt.block_keys)} blocks"
            except NormalizerError as exc:
                outcome = f"400 {exc.code}"
            took.append(time.process_time() - started)
        out[shape] = {
            "bytes": len(raw),
            "median_ms": round(statistics.median(took) * 1e3, 1),
            "outcome": outcome,
        }
    return out


def against_gateway(root: Path, shapes: list[str], seconds: float) -> dict[str, Any]:
    """A real gateway from `root` behind a static worker (`loadtest.bench_loop_stall`'s stack and
    prober): for each shape, its body posted back to back for `seconds` while `GET /health` is
    probed every 10 ms; the slowest probe, the statuses and the median request time."""
    import os

    from loadtest import bench_loop_stall as stall

    out: dict[str, Any] = {"load_average": os.getloadavg()}
    with stall.gateway_stack(root, "least_load") as port:
        prober = stall.Prober(port)
        time.sleep(seconds)
        out["baseline"] = stall._summary(prober.stop())
        for shape in shapes:
            body = orjson.dumps({"model": stall.MODEL, "max_tokens": 1, **body_of(shape)})
            head = stall._chat_head(len(body))
            prober = stall.Prober(port)
            time.sleep(1.0)  # the prober's interpreter starts and connects
            statuses: dict[int, int] = {}
            took: list[float] = []
            with socket.create_connection(("127.0.0.1", port)) as sock:
                ends_s = time.monotonic() + seconds
                while time.monotonic() < ends_s:
                    started = time.monotonic()
                    status = stall._request(sock, head, body)
                    took.append(time.monotonic() - started)
                    statuses[status] = statuses.get(status, 0) + 1
            out[shape] = {
                **stall._summary(prober.stop()),
                "statuses": statuses,
                "median_request_ms": round(statistics.median(took) * 1e3, 1),
            }
    out["load_average_after"] = os.getloadavg()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="in process: runs per shape")
    parser.add_argument(
        "--seconds", type=float, default=4.0, help="real gateway: seconds of posting per shape"
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument(
        "--gateway-root", type=Path, default=None, help="time a real gateway from this checkout"
    )
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    if args.gateway_root is None:
        for shape, row in in_process(shapes, args.repeats).items():
            print(f"{shape:24s} {row['bytes']:7d} B  {row['median_ms']:6.1f} ms  {row['outcome']}")
    else:
        print(json.dumps(against_gateway(args.gateway_root.resolve(), shapes, args.seconds), indent=1))


if __name__ == "__main__":
    main()
