"""`kvgate emulate` / `python -m loadtest.emulator`: run one emulated vLLM worker."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from loadtest.emulator.config import EmulatorConfig
from loadtest.engine.profile import DEFAULT_PROFILE, ProfileError, load_profile
from loadtest.engine.tokenizer import TokenizerError, load_tokenizer


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--model", default="emulated-llama", help="served model name")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="step-time profile name or YAML path")
    parser.add_argument("--kv-blocks", type=_positive_int, default=None, help="KV blocks (default: profile)")
    parser.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--time-scale", type=_positive_float, default=1.0, help="model seconds per real second (>1 = faster)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for block-hash root, answers and jitter")
    parser.add_argument(
        "--tokenizer", default=None, help="local HF tokenizer.json (default: one token per byte)"
    )
    parser.add_argument(
        "--default-max-tokens", type=_positive_int, default=128, help="when a request sets none"
    )
    parser.add_argument("--max-model-len", type=_positive_int, default=131072, help="longest prompt + output")
    parser.add_argument("--max-waiting", type=_positive_int, default=4096, help="bound of the waiting queue")
    parser.add_argument(
        "--jitter", type=float, default=0.0, help="per-step lognormal jitter sigma (e.g. 0.03)"
    )
    parser.add_argument(
        "--kv-events-endpoint", default=None, help="ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557"
    )
    parser.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ ROUTER endpoint for replay")
    parser.add_argument(
        "--kv-events-encoding",
        choices=("array", "map"),
        default="array",
        help="msgpack shape of each KV event: array (default) or map",
    )
    parser.add_argument("--kv-events-topic", default="", help="topic frame of every event message")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="log verbosity (default warning)",
    )


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        profile=args.profile,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        time_scale=args.time_scale,
        seed=args.seed,
        tokenizer=args.tokenizer,
        default_max_tokens=args.default_max_tokens,
        max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting,
        jitter_frac=args.jitter,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_encoding=args.kv_events_encoding,
        kv_events_topic=args.kv_events_topic,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from loadtest.emulator.app import create_app
    from loadtest.emulator.kv_events import publisher_factory

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = config_from_args(args)
    try:  # fail fast on a bad profile or tokenizer, before binding the port
        load_profile(cfg.profile)
        load_tokenizer(cfg.tokenizer)
    except (ProfileError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = create_app(cfg, publisher_factory(cfg))
    # In-flight streams get two seconds to finish on SIGTERM; then connections are closed.
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.emulator", description="Run one emulated vLLM worker"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
