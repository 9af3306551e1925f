"""`kvgate serve`: run the gateway from a config file, or a self-contained demo.

`--demo` starts N emulated vLLM workers as child processes on 127.0.0.1, waits until they answer
GET /health, and serves them under a built-in config (model `kvgate-demo`, one strict tenant with
the demo key). Every child runs in its own process group and is stopped by PID on exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from pydantic import ValidationError

from gateway.auth import hash_api_key
from gateway.config import GatewayConfig, load_config, read_secret, revalidated
from gateway.config.base import ConfigError
from gateway.config.pool import read_worker_key
from gateway.config.sync import SyncConfig
from gateway.lifecycle import in_terminal
from gateway.logs import LOG_LEVELS, setup_logging
from gateway.policy_watch import LoadedPolicy, PolicyWatcher
from gateway.state import PolicySwap, warn_unknown_names
from policies.config import PolicyConfig, PolicyConfigError, build_policy
from policies.identity import RESERVED_KEY_PREFIX, reserved_key_hashes
from policies.registry import known_policies

DEMO_MODEL = "kvgate-demo"
DEMO_KEY = "sk-kvgate-demo"
DEMO_WORKERS = 2
DEMO_PD_PROTOCOL = "vllm"
# Flags that only the demo reads, by destination. Their parser defaults are None so that a flag
# given without --demo can be told from one left out (`apply_mode_flags`).
DEMO_FLAGS = {"--workers": "workers", "--pd": "pd", "--pd-protocol": "pd_protocol", "--demo-key": "demo_key"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--config", metavar="FILE", help="gateway config YAML (see docs/config.md)")
    mode.add_argument("--demo", action="store_true", help="start emulated workers and serve them")
    mode.add_argument(
        "--hash-key",
        action="store_true",
        help="read an API key on stdin and print its config hash (secret, at least 32 bytes, from "
        "KVGATE_KEY_SECRET or --secret-file)",
    )
    parser.add_argument(
        "--secret-file",
        metavar="FILE",
        help="with --hash-key: read the key-hash secret from FILE (a gateway started with --config "
        "reads it from the config's secrets.key_hash_secret_file or _env)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help=f"demo: number of emulated workers (default {DEMO_WORKERS})"
    )
    parser.add_argument(
        "--pd",
        metavar="P:D",
        default=None,
        help="demo: P prefill and D decode emulated workers (prefill/decode disaggregation), "
        "instead of --workers mixed ones; or holder_prefill: --workers mixed ones in that pd mode",
    )
    parser.add_argument(
        "--pd-protocol",
        choices=("vllm", "sglang"),
        default=None,
        help="demo: the P/D wire protocol, vLLM's kv_transfer_params or SGLang's bootstrap_* "
        f"(default {DEMO_PD_PROTOCOL})",
    )
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1 or the config's)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default 8080 or the config's)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="port of the /metrics listener (default 9464 or the config's metrics.listen; 0: a free port)",
    )
    parser.add_argument(
        "--demo-key", default=None, help=f"demo: the API key clients use (default {DEMO_KEY})"
    )
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=None,
        help="log verbosity, any case (default the config's log_level, else info)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="serve the port from N processes (SO_REUSEPORT) that share routing state through the "
        "sync broker: --sync-url or the config's sync.url, else a local nats-server (docs/sync.md)",
    )
    parser.add_argument(
        "--watchdog-s",
        type=float,
        default=30.0,
        metavar="S",
        help="with --processes above 1: kill and restart a process whose event loop has not run for "
        "S seconds (its heartbeat stopped); 0: off (default 30)",
    )
    parser.add_argument("--sync-url", default=None, help="replica sync broker URL (overrides sync.url)")
    parser.add_argument(
        "--sync-token-env",
        default=None,
        metavar="NAME",
        help="read the sync broker's token from environment variable NAME (overrides sync.auth; "
        "set by --processes for its children when it runs the broker)",
    )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind the client port with SO_REUSEPORT (set by --processes for its children)",
    )


def apply_mode_flags(args: argparse.Namespace) -> None:
    """Refuse a flag that the chosen mode would ignore, and fill in the demo's defaults.

    Ignored silently, `--secret-file` with `--config` let the start fail on the secret it was
    meant to name ("KVGATE_KEY_SECRET is not set"), and `--workers 4` with `--config` served the
    config's workers without a word."""
    if not args.demo:
        given = [flag for flag, dest in DEMO_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)}: only with --demo (a config file names its own workers, "
                "tenants and keys)"
            )
    if args.demo and args.pd_protocol is not None and args.pd is None:
        raise ConfigError("--pd-protocol: only with --pd P:D (the demo's workers are mixed without it)")
    if args.secret_file is not None and not args.hash_key:
        raise ConfigError(
            "--secret-file: only with --hash-key (the gateway reads its key-hash secret from the "
            "config's secrets.key_hash_secret_file or secrets.key_hash_secret_env)"
        )
    if args.workers is None:
        args.workers = DEMO_WORKERS
    if args.pd_protocol is None:
        args.pd_protocol = DEMO_PD_PROTOCOL
    if args.demo_key is None:
        args.demo_key = DEMO_KEY


def load_policy(config: GatewayConfig) -> tuple[LoadedPolicy, PolicyWatcher | None, PolicySwap]:
    """The routing policy: from the policy file (watched for hot reload), or the built-in
    defaults of `policies.config.PolicyConfig` when no file is configured."""
    swap = PolicySwap()
    if config.policy_file is None:
        policy_config = PolicyConfig()
        return LoadedPolicy(build_policy(policy_config), policy_config, ""), None, swap
    watcher = PolicyWatcher(config.policy_file, on_swap=swap, interval_s=config.policy_reload_interval_s)
    try:
        loaded = watcher.load_initial()
    except OSError as exc:
        raise ConfigError(f"policy_file: cannot read {config.policy_file!r}: {exc.strerror}") from None
    warn_unknown_names(config, loaded.config)
    return loaded, watcher, swap


def demo_policy_name() -> str:
    return "cost" if "cost" in known_policies() else "least_load"


def with_listen(
    config: GatewayConfig, host: str | None, port: int | None, metrics_port: int | None = None
) -> GatewayConfig:
    """The config with `--host`, `--port` and `--metrics-port` applied, checked as the YAML is."""
    update: dict[str, Any] = {
        "listen": {
            "host": host if host is not None else config.listen.host,
            "port": port if port is not None else config.listen.port,
        }
    }
    if metrics_port is not None:
        update["metrics"] = {"listen": {"host": config.metrics.listen.host, "port": metrics_port}}
    try:
        return revalidated(config, **update)
    except ConfigError as exc:
        given = [
            f"{flag} {value}"
            for flag, value in (("--host", host), ("--port", port), ("--metrics-port", metrics_port))
            if value is not None
        ]
        raise ConfigError(f"{', '.join(given)}: {exc}" if given else str(exc)) from None


def read_start_secrets(config: GatewayConfig) -> bytes:
    """Every secret the config names, read once before anything starts, so that a missing one
    stops the start with a message naming its field (once, not once per process): the key-hash
    secret (returned), each pool's worker key, the sync broker's credentials and its sentinels'."""
    secret = read_secret(config.secrets, dict(os.environ))
    refuse_reserved_key_hashes(config, secret)
    for pool in config.pools:
        read_worker_key(pool, os.environ)
    if config.sync.url is not None:
        from gateway.sync.auth import connect_options, sentinel_credentials

        connect_options(config.sync, os.environ)
        sentinel_credentials(config.sync, os.environ)
    return secret


def refuse_reserved_key_hashes(config: GatewayConfig, secret: bytes) -> None:
    """A `ConfigError` when a tenant's or the admin's key hash is a reserved key's
    (`policies.identity.RESERVED_KEY_PREFIX`): that hash would be one of the secret's sub-secrets."""
    reserved = reserved_key_hashes(secret)
    fields = [(f"tenants[{i}].api_key_hashes", t.api_key_hashes) for i, t in enumerate(config.tenants)]
    fields.append(("admin.api_key_hash", [config.admin.api_key_hash] if config.admin.api_key_hash else []))
    for field, hashes in fields:
        if any(h in reserved for h in hashes):
            raise ConfigError(
                f"{field}: the hash of a reserved key (keys beginning with {RESERVED_KEY_PREFIX!r} are"
                " the gateway's own; choose another key)"
            )


def with_sync(config: GatewayConfig, url: str | None, token_env: str | None) -> GatewayConfig:
    """The config with `--sync-url` and `--sync-token-env` applied (and checked as the YAML is)."""
    fields = config.sync.model_dump()
    if url is not None:
        fields["url"] = url
    if token_env is not None:
        fields["auth"] = {"token_env": token_env}
    try:
        sync = SyncConfig.model_validate(fields)
    except ValidationError as exc:
        raise ConfigError(f"--sync-url / --sync-token-env: {exc.errors()[0]['msg']}") from None
    return config.model_copy(update={"sync": sync})


def run(args: argparse.Namespace) -> int:
    from gateway.server import serve  # uvicorn is imported only when serving

    if not in_terminal():
        # A service's SIGHUP asks for a reload: ignored until the server (or the supervisor)
        # takes it, so one that comes while the gateway starts cannot kill it.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    setup_logging(args.log_level or "info")
    try:
        apply_mode_flags(args)
        if args.hash_key:
            return _hash_key(args)
        if args.processes != 1:
            from gateway.multiproc import supervise

            return supervise(args)
        if args.demo:
            from gateway.demo import run_demo

            def serve_demo(config: GatewayConfig, secret: bytes, loaded: LoadedPolicy) -> int:
                return serve(with_sync(config, args.sync_url, args.sync_token_env), secret, loaded)

            return run_demo(args, serve_demo)
        config = with_listen(load_config(args.config), args.host, args.port, args.metrics_port)
        config = with_sync(config, args.sync_url, args.sync_token_env)
        if args.log_level is None:
            setup_logging(config.log_level)
        secret = read_start_secrets(config)
        loaded, watcher, swap = load_policy(config)
    except (ConfigError, PolicyConfigError) as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    return serve(config, secret, loaded, watcher, swap, reuse_port=args.reuse_port)


# Random keys of 32 hex characters carry 128 bits; OpenAI's own keys are longer.
MIN_API_KEY_CHARS = 32


def _hash_key(args: argparse.Namespace) -> int:
    from gateway.config import SecretsConfig

    secrets = SecretsConfig(key_hash_secret_file=args.secret_file) if args.secret_file else SecretsConfig()
    secret = read_secret(secrets, dict(os.environ))
    key = sys.stdin.readline().strip()
    if not key:
        print("kvgate serve --hash-key: no key on stdin", file=sys.stderr)
        return 2
    if key.startswith(RESERVED_KEY_PREFIX):
        print(
            f"kvgate serve --hash-key: keys beginning with {RESERVED_KEY_PREFIX!r} are reserved;"
            " choose another",
            file=sys.stderr,
        )
        return 2
    if len(key) < MIN_API_KEY_CHARS:
        # Still hashed: existing keys keep working. Only the hash is checked, so nothing but the key's
        # own length stands between a guesser and it (an admin key's wrong guesses are throttled).
        print(
            f"kvgate serve --hash-key: warning: the key is {len(key)} characters; a key under"
            f" {MIN_API_KEY_CHARS} can be guessed. Make keys long and random: openssl rand -hex 32",
            file=sys.stderr,
        )
    print(hash_api_key(secret, key))
    return 0
