"""How long other requests wait while the gateway reads and keys large bodies.

    python -m loadtest.bench_loop_stall --gateway-root . --repeats 3 [--policy least_load]

Starts a static worker (`loadtest.static_backend`, which answers at once whatever the body), the
gateway (`python -m gateway.cli serve` from `--gateway-root`, so two checkouts can be compared)
with one pool of it, and a prober process that sends `GET /health` every 10 ms on one keep-alive
connection and records each answer's latency. First a baseline with no other load, then, for
each body shape, the same probe while `--repeats` large chat bodies of that shape (about 7 MB,
under the gateway's 8 MiB body limit) are posted one after another. Printed per phase: the
slowest and the p99 probe latency (ms), the five slowest, the number of probes, and the large
requests' statuses and median latency; and the median and p99 latency of 300 small chat
requests posted one after another after the baseline (the inline path). The shapes are the
ones whose keying cost is described in docs/normalizer.md: one message of 93,000 image parts,
190,000 short messages with a session key, one 7 MB text, 20,000 tool calls (canonical JSON),
and one non-ASCII text. The default
policy keeps no prefix index, so the probe sees reading and keying; `--policy cost` adds the
index's work on each request's keys. Nothing here imports the gateway: it is started as a
process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loadtest.checkout_gateway import start_gateway, start_ready
from loadtest.ports import free_port

SECRET = "bench-loop-stall-key-hash-secret-32"
KEY = "sk-bench"
MODEL = "bench-model"  # loadtest.static_backend's
PROBE_INTERVAL_S = 0.01


def _images() -> dict[str, Any]:
    # As many images as a request may carry (`MAX_MEDIA_PARTS`), each a data URL of 3.5 KB.
    pixels = "A" * 3500
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i:08d}{pixels}"}}
        for i in range(2048)
    ]
    return {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]}


def _messages() -> dict[str, Any]:
    turns = [{"role": "user" if i % 2 else "assistant", "content": f"q{i} x"} for i in range(190_000)]
    return {"messages": turns, "user": "bench-session"}


def _text() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "lorem ipsum dolor " * 390_000}]}


def _tools() -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    for i in range(20_000):
        arguments = json.dumps({"b": i, "a": [1, 2, 3], "z": "xyzw" * 30})
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": arguments}}
        turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        turns.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
    return {"messages": turns}


def _unicode() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "lörem ípsum dólor " * 330_000}]}


SHAPES: dict[str, Callable[[], dict[str, Any]]] = {
    "images": _images,
    "messages": _messages,
    "text": _text,
    "tools": _tools,
    "unicode": _unicode,
}


def body_of(shape: str) -> bytes:
    """The shape's chat body, encoded (`max_tokens` 1: the worker's answer is not what is timed)."""
    body = {"model": MODEL, "max_tokens": 1, **SHAPES[shape]()}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _request(sock: socket.socket, head: bytes, body: bytes = b"") -> int:
    """One HTTP/1.1 exchange on a keep-alive connection; the answer's status."""
    sock.sendall(head + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    lines = header.split(b"\r\n")
    length = next(int(h.split(b":")[1]) for h in lines if h.lower().startswith(b"content-length"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        rest += chunk
    return int(lines[0].split()[1])


def probe(port: int) -> None:
    """The prober process: `GET /health` every 10 ms until stdin closes, then each latency (s)
    as one JSON list on stdout."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    latencies: list[float] = []
    sock = socket.create_connection(("127.0.0.1", port))
    os.set_blocking(sys.stdin.fileno(), False)
    next_s = time.monotonic()
    while True:
        try:
            if os.read(sys.stdin.fileno(), 1) == b"":
                break
        except BlockingIOError:
            pass
        started = time.monotonic()
        _request(sock, head)
        latencies.append(time.monotonic() - started)
        next_s = max(next_s + PROBE_INTERVAL_S, time.monotonic())
        time.sleep(max(0.0, next_s - time.monotonic()))
    sock.close()
    print(json.dumps(latencies))


class Prober:
    """A prober process for one phase."""

    def __init__(self, port: int) -> None:
        argv = [sys.executable, "-m", "loadtest.bench_loop_stall", "--probe", str(port)]
        here = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": str(here)}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=here)

    def stop(self) -> list[float]:
        out, _ = self.proc.communicate(timeout=60)
        latencies: list[float] = json.loads(out)
        return latencies


def _summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "slowest_ms": round(ordered[-1] * 1e3, 1),
        "p99_ms": round(p99 * 1e3, 1),
        "probes": len(ordered),
        "slowest_5_ms": [round(x * 1e3, 1) for x in ordered[-5:]],
    }


def _gateway(root: Path, folder: Path, worker_port: int, policy: str) -> tuple[subprocess.Popen[bytes], int]:
    """The gateway from `root`, one pool of the static worker, `policy`, one tenant."""
    pools = [{"name": "bench", "models": [MODEL], "workers": [f"http://127.0.0.1:{worker_port}"]}]
    return start_gateway(root, folder, secret=SECRET, key=KEY, pools=pools, policy=policy)


def _worker(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The static worker (`loadtest.static_backend`): answers at once, whatever the body."""
    port = free_port()
    here = Path(__file__).resolve().parent.parent
    argv = [sys.executable, "-m", "loadtest.static_backend", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(here)}
    proc = start_ready(argv, env, here, folder / "worker.log", f"http://127.0.0.1:{port}/health")
    return proc, port


def _chat_head(length: int) -> bytes:
    """A chat request's head with the bench tenant's key, for a body of `length` bytes."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
    )


def _post_all(port: int, body: bytes, repeats: int) -> tuple[Counter[int], float]:
    head = _chat_head(len(body))
    statuses: Counter[int] = Counter()
    took: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(repeats):
            started = time.monotonic()
            statuses[_request(sock, head, body)] += 1
            took.append(time.monotonic() - started)
    return statuses, statistics.median(took)


SMALL_REQUESTS = 300


def _small_requests(port: int, n: int) -> dict[str, float]:
    """Median and p99 latency (ms) of `n` small chat requests, one after another: the inline path."""
    body = json.dumps(
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi " * 200}]}
    )
    head = _chat_head(len(body))
    took: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(n):
            started = time.monotonic()
            _request(sock, head, body.encode())
            took.append(time.monotonic() - started)
    took.sort()
    return {
        "median_ms": round(statistics.median(took) * 1e3, 2),
        "p99_ms": round(took[int(0.99 * n)] * 1e3, 2),
    }


def _settle() -> None:
    time.sleep(0.5)  # let the prober connect and the gateway go idle between phases


def _measure(
    port: int, bodies: dict[str, bytes], repeats: int, baseline_s: float, out: dict[str, Any]
) -> None:
    """The baseline, the small requests, then each shape's large bodies, into `out`."""
    prober = Prober(port)
    time.sleep(baseline_s)
    out["baseline"] = _summary(prober.stop())
    out["small_requests"] = _small_requests(port, SMALL_REQUESTS)
    for shape, body in bodies.items():
        prober = Prober(port)
        _settle()
        statuses, median_s = _post_all(port, body, repeats)
        out[shape] = {
            **_summary(prober.stop()),
            "body_mb": round(len(body) / 1e6, 2),
            "statuses": dict(statuses),
            "median_request_s": round(median_s, 3),
        }


@contextlib.contextmanager
def gateway_stack(root: Path, policy: str) -> Iterator[int]:
    """A gateway from `root`'s checkout behind the static worker, both stopped by PID on exit;
    yields the gateway's port."""
    with tempfile.TemporaryDirectory() as tmp:
        worker, worker_port = _worker(Path(tmp))
        try:
            gateway, port = _gateway(root, Path(tmp), worker_port, policy)
            try:
                yield port
            finally:
                gateway.terminate()
                gateway.wait(30)
        finally:
            worker.terminate()
            worker.wait(30)


def run(root: Path, shapes: list[str], repeats: int, baseline_s: float, policy: str) -> dict[str, Any]:
    bodies = {shape: body_of(shape) for shape in shapes}
    out: dict[str, Any] = {"policy": policy, "load_average": os.getloadavg()}
    with gateway_stack(root, policy) as port:
        _measure(port, bodies, repeats, baseline_s, out)
    out["load_average_after"] = os.getloadavg()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gateway-root", type=Path, default=Path.cwd(), help="checkout whose gateway runs")
    parser.add_argument("--repeats", type=int, default=3, help="large bodies posted per shape, one at a time")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--baseline-s", type=float, default=3.0, help="seconds of probing without load")
    parser.add_argument(
        "--policy",
        default="least_load",
        help="routing policy (least_load: no prefix index, so what is timed is reading and keying; "
        "cost indexes every key of every request too)",
    )
    parser.add_argument(
        "--write-bodies",
        type=Path,
        default=None,
        metavar="DIR",
        help="only write each shape's body to DIR/SHAPE.json (for python -m gateway.keying_bench)",
    )
    parser.add_argument("--probe", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe is not None:
        probe(args.probe)
        return
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    if args.write_bodies is not None:
        args.write_bodies.mkdir(parents=True, exist_ok=True)
        for shape in shapes:
            (args.write_bodies / f"{shape}.json").write_bytes(body_of(shape))
        return
    result = run(args.gateway_root.resolve(), shapes, args.repeats, args.baseline_s, args.policy)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
