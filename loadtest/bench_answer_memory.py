"""The gateway's peak memory while it reads many large non-streamed answers at once.

    python -m loadtest.bench_answer_memory --gateway-root . --requests 16 --answer-mb 60
    python -m loadtest.bench_answer_memory --gateway-root . --requests 16 --answer-mb 60 --late-readers 8

One raw-socket worker answers every chat request with the same prebuilt JSON answer of
`--answer-mb` MB: all of it but its last byte at once, the last byte when every request of its
wave has had the rest (or had its connection dropped by the gateway), so that all the answers of
a wave are held in the gateway at the same time. The gateway (`python -m gateway.cli serve` from
`--gateway-root`, so two checkouts can be compared) serves one pool with that worker.

With `--late-readers K`, the first wave is K clients that read their answer's status line (sent
once the gateway has read the answer whole) and then nothing more until the second wave, the
other requests, has ended: their answers are still being written while the second wave's are
read, as they would be for slow clients.

Printed: the gateway's RSS before the load and its peak (VmHWM from /proc) after, and the
statuses the clients got (the late readers' also apart; the end of each non-200 answer goes to
stderr). Nothing here imports the gateway: it is started as a process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from loadtest.checkout_gateway import post_chat, read_worker_request, start_gateway

SECRET = "bench-answer-memory-key-hash-secret"
KEY = "sk-bench"


def _answer(size: int) -> bytes:
    content = "x" * size
    body = json.dumps(
        {
            "id": "cmpl-bench",
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Worker:
    """Answers requests in waves of `requests`; the last bytes of a wave's answers wait until
    every one of the wave has had the rest."""

    def __init__(self, answer: bytes, requests: int) -> None:
        self.answer = answer
        self.expect(requests)

    def expect(self, requests: int) -> None:
        """The next wave: `requests` requests."""
        self.requests = requests
        self.sent = 0
        self.all_sent = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        all_sent = self.all_sent  # this request's wave
        posted = True  # a connection that fails before its request counts as one of the wave
        try:
            posted = await read_worker_request(reader, writer)
            if not posted:
                return
            writer.write(memoryview(self.answer)[:-1])
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            if posted:
                self.sent += 1
                if self.sent >= self.requests:
                    self.all_sent.set()
        await all_sent.wait()
        try:
            writer.write(self.answer[-1:])
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _gateway(
    root: Path, folder: Path, worker_port: int, budget_bytes: int | None
) -> tuple[subprocess.Popen[bytes], int]:
    pools = [{"name": "big", "models": ["m-big"], "workers": [f"http://127.0.0.1:{worker_port}"]}]
    limits = {"max_buffered_answer_bytes": budget_bytes} if budget_bytes is not None else None
    return start_gateway(
        root, folder, secret=SECRET, key=KEY, pools=pools, policy="round_robin", limits=limits
    )


async def _post(port: int, late: asyncio.Future[int] | None = None, go: asyncio.Event | None = None) -> int:
    """One request; a late reader (`late` and `go` given) sets `late` to its status, then reads
    nothing more until `go`."""
    body = json.dumps({"model": "m-big", "messages": [{"role": "user", "content": "x"}]}).encode()
    # A late reader's small receive buffer: the kernel takes little of its unread answer.
    reader, writer, status = await post_chat(port, KEY, body, small_window=late is not None)
    if late is not None and go is not None:
        late.set_result(status)
        await go.wait()
    rest = b""
    while data := await reader.read(1 << 20):
        rest = (rest + data)[-400:]
    writer.close()
    if status != 200:
        print(status, rest[-300:], file=sys.stderr)
    return status


async def run(
    root: Path, requests: int, answer_mb: int, budget_bytes: int | None, late_readers: int = 0
) -> dict[str, object]:
    worker = Worker(_answer(answer_mb * 1000 * 1000), late_readers or requests)
    server = await asyncio.start_server(worker.serve, "127.0.0.1", 0)
    worker_port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = await asyncio.to_thread(_gateway, root, Path(tmp), worker_port, budget_bytes)
        try:
            before_kib = _status_kib(proc.pid, "VmRSS")
            go = asyncio.Event()
            heads: list[asyncio.Future[int]] = [loop.create_future() for _ in range(late_readers)]
            late = [asyncio.create_task(_post(port, head, go)) for head in heads]
            late_statuses = await asyncio.gather(*heads)  # every late answer read by the gateway
            worker.expect(requests - late_readers)
            statuses = await asyncio.gather(*(_post(port) for _ in range(requests - late_readers)))
            go.set()
            statuses += await asyncio.gather(*late)
            peak_kib = _status_kib(proc.pid, "VmHWM")
        finally:
            proc.terminate()
            proc.wait(30)
    server.close()
    result: dict[str, object] = {
        "rss_before_mb": round(before_kib / 1024),
        "peak_rss_mb": round(peak_kib / 1024),
        "statuses": dict(Counter(statuses)),
    }
    if late_readers:
        result["late_statuses"] = dict(Counter(late_statuses))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway-root", type=Path, default=Path.cwd(), help="checkout whose gateway runs")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--answer-mb", type=int, default=60)
    parser.add_argument("--budget-bytes", type=int, default=None, help="limits.max_buffered_answer_bytes")
    parser.add_argument(
        "--late-readers", type=int, default=0, help="requests (of --requests) whose clients read late"
    )
    args = parser.parse_args()
    if not 0 <= args.late_readers <= args.requests:
        parser.error("--late-readers must be between 0 and --requests")
    root = args.gateway_root.resolve()
    result = asyncio.run(run(root, args.requests, args.answer_mb, args.budget_bytes, args.late_readers))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
