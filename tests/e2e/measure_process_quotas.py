"""How many requests one tenant gets admitted behind `kvgate serve --processes P`, against its rpm.

`python -m tests.e2e.measure_process_quotas --rpm 60 --processes 2 --clients 16 --requests 240
[--repeats 3]`: an emulated worker, a gateway of P processes on one port, one tenant with that
`rpm`; C client threads send the requests, each over a fresh connection (the kernel deals
connections to either process). Prints per run what was admitted and its ratio to what one shared
bucket allows in that time (the rpm plus its refill while the requests went out). Every process
is stopped by PID on the way out."""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import time
from pathlib import Path

import httpx

from tests.e2e.harness import (
    SECRET,
    serving_processes,
    start_emulator,
    tenant,
    write_gateway_config,
)

KEY = "sk-measure-quotas"


def _run(rpm: int, processes: int, clients: int, requests: int, folder: Path) -> tuple[int, float]:
    """(requests admitted, seconds they took to send) for one fresh gateway."""
    worker, emulator = start_emulator("--model", "m", "--time-scale", "50")
    try:
        pools = [{"name": "p", "models": ["m"], "workers": [worker]}]
        config = write_gateway_config(folder / "gw.yaml", pools, [tenant("t", KEY, quotas={"rpm": rpm})])
        env = {"KVGATE_KEY_SECRET": SECRET.decode()}
        with serving_processes("--config", str(config), processes=processes, env=env) as (base_url, _):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

            def one(_: int) -> int:
                with httpx.Client(timeout=30) as client:
                    url = f"{base_url}/v1/chat/completions"
                    return client.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}).status_code

            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                statuses = list(pool.map(one, range(requests)))
            return statuses.count(200), time.monotonic() - started
    finally:
        emulator.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rpm", type=int, default=60)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            admitted, took_s = _run(args.rpm, args.processes, args.clients, args.requests, Path(folder))
        allowed = args.rpm + args.rpm * took_s / 60
        print(
            f"rpm {args.rpm}, {args.processes} processes, {args.clients} clients: {admitted} of "
            f"{args.requests} admitted in {took_s:.1f} s; one shared bucket allows {allowed:.1f}: "
            f"{admitted / allowed:.2f}x"
        )


if __name__ == "__main__":
    main()
