"""`kvgate emulate` / `python -m loadtest.emulator`: run one emulated vLLM worker."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence

from loadtest.cli_args import positive_float, positive_int
from loadtest.emulator.config import EmulatorConfig
from loadtest.engine.profile import DEFAULT_PROFILE, ProfileError, load_profile
from loadtest.engine.tokenizer import TokenizerError, load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--model", default="emulated-llama", help="served model name")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="step-time profile name or YAML path")
    parser.add_argument("--kv-blocks", type=positive_int, default=None, help="KV blocks (default: profile)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--time-scale", type=positive_float, default=1.0, help="model seconds per real second (>1 = faster)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for block-hash root, answers and jitter")
    parser.add_argument(
        "--tokenizer", default=None, help="local HF tokenizer.json (default: one token per byte)"
    )
    parser.add_argument(
        "--default-max-tokens", type=positive_int, default=128, help="when a request sets none"
    )
    parser.add_argument("--max-model-len", type=positive_int, default=131072, help="longest prompt + output")
    parser.add_argument("--max-waiting", type=positive_int, default=4096, help="bound of the waiting queue")
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
    pd = parser.add_argument_group("prefill/decode disaggregation (docs/pd.md)")
    pd.add_argument(
        "--role",
        choices=("prefill", "decode", "mixed"),
        default="mixed",
        help="worker role: reported in /server_info; decides how SGLang bootstrap_* fields are served",
    )
    pd.add_argument(
        "--pd-protocol",
        choices=("any", "sglang"),
        default="any",
        help="sglang: a decode-role worker refuses a generation request without bootstrap_room, as "
        "an SGLang decode server does (any: it runs it whole, as a vLLM decode server does)",
    )
    pd.add_argument(
        "--kv-engine-id", default=None, help="engine id named in kv_transfer_params (default random)"
    )
    pd.add_argument(
        "--kv-advertise-host", default=None, help="host decode workers pull KV from (default: --host)"
    )
    pd.add_argument(
        "--bootstrap-port",
        type=int,
        default=None,
        help="also listen here, as SGLang's prefill bootstrap port",
    )
    pd.add_argument(
        "--kv-transfer-timeout-s",
        type=positive_float,
        default=300.0,
        help="decode side: give up a KV transfer after this many real seconds (default 300)",
    )
    pd.add_argument(
        "--kv-bootstrap-timeout-s",
        type=positive_float,
        default=300.0,
        help="prefill side: wait this long for the decode worker of a bootstrap room (default 300)",
    )
    pd.add_argument(
        "--kv-hold-timeout-s",
        type=positive_float,
        default=480.0,
        help="prefill side: free unread KV after this many real seconds (default 480)",
    )
    pd.add_argument(
        "--kv-load-failure-policy",
        choices=("fail", "recompute"),
        default="fail",
        help="decode side, on a failed transfer: answer 500 (fail, default) or prefill locally",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="as vLLM's --api-key: /v1 routes answer 401 without 'Authorization: Bearer KEY'",
    )
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
        role=args.role,
        pd_protocol=args.pd_protocol,
        kv_engine_id=args.kv_engine_id,
        kv_advertise_host=args.kv_advertise_host,
        bootstrap_port=args.bootstrap_port,
        kv_transfer_timeout_s=args.kv_transfer_timeout_s,
        kv_bootstrap_timeout_s=args.kv_bootstrap_timeout_s,
        kv_hold_timeout_s=args.kv_hold_timeout_s,
        kv_load_failure_policy=args.kv_load_failure_policy,
        api_key=args.api_key,
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
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    if cfg.bootstrap_port is None:
        server.run()
        return 0
    # SGLang routers reach a prefill worker's bootstrap server on its own port: serve the same
    # app there too (the bootstrap route is one of its routes).
    sockets = [_listen(cfg.host, cfg.port), _listen(cfg.host, cfg.bootstrap_port)]
    server.run(sockets=sockets)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.emulator", description="Run one emulated vLLM worker"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
