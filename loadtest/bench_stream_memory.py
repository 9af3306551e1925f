"""The gateway's memory while many streamed answers wait on clients that read nothing.

    python -m loadtest.bench_stream_memory --streams 400
    python -m loadtest.bench_stream_memory --streams 400 --stream-budget-bytes 16777216

Raw-socket workers (`--workers`, default 2) answer every streamed chat request with events of
about 1 KiB, as fast as the gateway reads them, up to `--stream-mb` MiB each (a stream that sends
all of it before its writes block is counted as finished). The clients send their requests, read
the status line and then nothing: each stream fills what the kernel and the gateway's client
connection take, then the gateway's unread buffer for it, until the gateway stops reading from
the worker. Once every worker connection is finished or blocked in a write, with nothing changing
for `--settle-s`, the gateway's RSS is read from /proc and its `kvgate_stream_bytes_buffered`
from its metrics listener; then the clients reset their connections.

`--stream-budget-bytes` sets `limits.max_buffered_stream_bytes` (a value larger than everything
the streams can hold, e.g. 1099511627776, takes the process-wide bound out of play: each stream
then stops at its own 1 MiB). Printed: RSS before the streams and with them, the buffered bytes,
how many streams reached the workers. Nothing here imports the gateway: it is started as a
process (`python -m gateway.cli serve` from `--gateway-root`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import urllib.request
from functools import partial
from pathlib import Path

from loadtest.checkout_gateway import post_chat, read_worker_request, start_gateway
from loadtest.ports import free_port

SECRET = "bench-stream-memory-key-hash-secret"
KEY = "sk-bench"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def _event() -> bytes:
    chunk = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "x" * 900}, "finish_reason": None}],
    }
    data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


class Workers:
    """Streams events to every request; counts the connections whose writes are blocked."""

    def __init__(self, stream_bytes: int) -> None:
        self.event = _event()
        self.stream_bytes = stream_bytes
        self.streams = 0
        self.blocked = 0
        self.finished = 0
        self.changed = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []

    def _note(self, delta: int) -> None:
        self.blocked += delta
        self.changed.set()

    async def settled(self, streams: int, settle_s: float) -> None:
        """Until all `streams` have reached a worker and each is finished or has been blocked in
        a write, with nothing changing, for `settle_s`."""
        while True:
            self.changed.clear()
            if self.streams >= streams and self.blocked + self.finished >= self.streams:
                try:
                    await asyncio.wait_for(self.changed.wait(), settle_s)
                except TimeoutError:
                    return
            else:
                await self.changed.wait()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            if not await read_worker_request(reader, writer):
                return
            self.streams += 1
            self.changed.set()
            writer.write(SSE_HEAD)
            sent = 0
            while sent < self.stream_bytes:
                writer.write(self.event)
                sent += len(self.event)
                if writer.transport.get_write_buffer_size() > 64 * 1024:
                    self._note(1)
                    try:
                        await writer.drain()
                    finally:
                        self._note(-1)
            data = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            await writer.drain()
            self.finished += 1
            self.changed.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


def _buffered_bytes(metrics_port: int) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for line in page.splitlines():
        if line.startswith("kvgate_stream_bytes_buffered "):
            return float(line.split()[1])
    return float("nan")


async def _open(port: int) -> asyncio.StreamWriter:
    """One streamed request whose client reads its status line and then nothing."""
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode()
    _, writer, status = await post_chat(port, KEY, body, small_window=True, close=False)
    if status != 200:
        raise RuntimeError(f"a stream was refused: {status}")
    return writer


async def run(
    root: Path, streams: int, workers: int, stream_mb: int, budget: int | None, settle_s: float
) -> dict[str, object]:
    pool = Workers(stream_mb * 1024 * 1024)
    servers = [await asyncio.start_server(pool.serve, "127.0.0.1", 0) for _ in range(workers)]
    urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    pools = [{"name": "p", "models": ["m"], "workers": urls, "max_in_flight_per_worker": streams}]
    limits = {"max_buffered_stream_bytes": budget} if budget is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        metrics_port = free_port()
        proc: subprocess.Popen[bytes]
        proc, port = await asyncio.to_thread(
            partial(
                start_gateway,
                root,
                folder,
                secret=SECRET,
                key=KEY,
                pools=pools,
                policy="round_robin",
                limits=limits,
                metrics_port=metrics_port,
            )
        )
        clients: list[asyncio.StreamWriter] = []
        try:
            before_mb = _rss_mb(proc.pid)
            clients = list(await asyncio.gather(*(_open(port) for _ in range(streams))))
            await pool.settled(streams, settle_s)
            with_mb = _rss_mb(proc.pid)
            buffered = await asyncio.to_thread(_buffered_bytes, metrics_port)
        finally:
            for writer in clients:
                writer.transport.abort()  # the sockets close on the loop's next turn
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 60)  # the loop runs on meanwhile
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for writer in pool.writers:
        writer.transport.abort()
    for server in servers:
        server.close()
        await server.wait_closed()
    return {
        "streams": pool.streams,
        "finished": pool.finished,
        "rss_before_mb": round(before_mb),
        "rss_with_streams_mb": round(with_mb),
        "stream_bytes_buffered_mb": round(buffered / (1024 * 1024), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway-root", type=Path, default=Path.cwd(), help="checkout whose gateway runs")
    parser.add_argument("--streams", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stream-mb", type=int, default=16, help="what each worker stream would send")
    parser.add_argument(
        "--stream-budget-bytes", type=int, default=None, help="limits.max_buffered_stream_bytes"
    )
    parser.add_argument("--settle-s", type=float, default=1.0, help="how long every write stays blocked")
    args = parser.parse_args()
    result = asyncio.run(
        run(
            args.gateway_root.resolve(),
            args.streams,
            args.workers,
            args.stream_mb,
            args.stream_budget_bytes,
            args.settle_s,
        )
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
