"""`kvgate normalize`: zones and block keys of one OpenAI request read on stdin.

Prints JSON with `zones` (zone, source, token span), `n_tokens`, `block_size`, `block_keys` (hex),
`public_block_keys`, `identity` (field names with keyed digests of the values), `diagnostics`. It
never prints prompt text or token ids. The key secret comes from the environment variable named by
`--secret-env` (default KVGATE_KEY_SECRET); without it a development secret is used and said so.
In `render` mode, `--render-url` names a worker on 127.0.0.1 whose render endpoint gives the ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import orjson
import yaml
from pydantic import ValidationError

from prompt_normalizer.config import NormalizerConfig
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import keyed_digest, public_identity_of, secret_key
from prompt_normalizer.normalizer import Normalizer
from prompt_normalizer.render import parse_render_token_ids
from prompt_normalizer.types import PUBLIC_NAMESPACE, CanonicalPrompt, KeyIdentity

DEV_SECRET = b"kvgate-development-secret"
MAX_STDIN_BYTES = 64 * 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", type=Path, help="policy YAML; its 'normalizer' section is used")
    parser.add_argument("--config", type=Path, help="gateway config YAML, for --pool")
    parser.add_argument(
        "--pool", help="with --config: that pool's own 'normalizer' when it has one (else the policy's)"
    )
    parser.add_argument("--tenant", default=PUBLIC_NAMESPACE, help="tenant namespace (default: public)")
    parser.add_argument("--model", help="model id (default: the request's 'model')")
    parser.add_argument("--endpoint", choices=("chat", "completions"), help="default: from the body")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--weights-version", default="", help="key identity: weights version")
    parser.add_argument("--tokenizer-version", default="", help="key identity: tokenizer version")
    parser.add_argument("--template-version", default="", help="key identity: chat-template version")
    parser.add_argument("--adapter", default="", help="key identity: LoRA adapter name")
    parser.add_argument("--kv-dtype", default="auto", help="key identity: KV-cache dtype (default auto)")
    parser.add_argument("--epoch", type=int, default=0, help="key identity: operator epoch (default 0)")
    parser.add_argument("--public", action="store_true", help="also print public_block_keys")
    parser.add_argument(
        "--secret-env",
        default="KVGATE_KEY_SECRET",
        help="env var holding the key-hash secret (unset: a development secret)",
    )
    parser.add_argument("--render-url", help="render mode: worker base URL on 127.0.0.1")


def load_config(
    path: Path | None, pool: str | None = None, gateway_config: Path | None = None
) -> NormalizerConfig:
    """The normalizer `kvgate serve` gives pool `pool`: the pool's own `normalizer` in the gateway
    config (`gateway_config`) when it has one, else the policy file's `normalizer` section, else
    the defaults."""
    section: Any = {}
    if path is not None:
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError("policy file must be a mapping")
        section = raw.get("normalizer", {}) or {}
    if pool is not None and gateway_config is not None:
        raw = yaml.safe_load(gateway_config.read_text()) or {}
        pools = raw.get("pools") if isinstance(raw, dict) else None
        found = [p for p in pools or [] if isinstance(p, dict) and p.get("name") == pool]
        if not found:
            raise ValueError(f"--pool {pool!r}: no such pool in {str(gateway_config)!r}")
        section = found[0].get("normalizer") or section
    elif pool is not None:
        raise ValueError("--pool needs --config (the gateway config, where pools are defined)")
    return NormalizerConfig.model_validate(section)


def _identity_report(identity: KeyIdentity, key: bytes) -> dict[str, str]:
    out = {}
    for f in dataclasses.fields(identity):
        value = orjson.dumps([f.name, getattr(identity, f.name)])
        out[f.name] = keyed_digest(key, value, b"kvgate-ident").hex()[:16]
    return out


def _render(url: str, path: str, body: Any) -> Any:
    import httpx

    if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise NormalizerError(
            "--render-url must be a loopback address", param="render_url", code="bad_config"
        )
    try:
        reply = httpx.post(url.rstrip("/") + path, json=body, timeout=10.0)
    except httpx.HTTPError as exc:
        raise NormalizerError(
            f"render endpoint unreachable: {type(exc).__name__}", code="render_failed"
        ) from None
    if reply.status_code != 200:
        try:
            code = reply.json()["error"].get("code") or reply.json()["error"].get("type")
        except (ValueError, KeyError, TypeError, AttributeError):
            code = None
        detail = f" ({code})" if isinstance(code, str) else ""
        raise NormalizerError(
            f"render endpoint answered HTTP {reply.status_code}{detail}", code="render_failed"
        )
    return reply.json()


def _canonicalize(
    norm: Normalizer,
    endpoint: str,
    body: dict[str, Any],
    identity: KeyIdentity,
    public: KeyIdentity | None,
    render_url: str | None,
) -> CanonicalPrompt:
    if norm.config.mode != "render" or (
        endpoint == "completions"
        and isinstance(body.get("prompt"), list)
        and body["prompt"]
        and isinstance(body["prompt"][0], int)
    ):
        return norm.canonicalize(endpoint, body, identity, public)  # type: ignore[arg-type]
    if render_url is None:
        raise NormalizerError(
            "render mode needs --render-url (a worker on 127.0.0.1)", code="render_required"
        )
    plan = norm.prepare_render(endpoint, body)  # type: ignore[arg-type]
    full = parse_render_token_ids(_render(render_url, plan.render_path, plan.body))
    bounds = []
    for sub in plan.boundary_bodies:
        try:
            bounds.append(
                None if sub is None else parse_render_token_ids(_render(render_url, plan.render_path, sub))
            )
        except NormalizerError:
            bounds.append(None)
    return norm.from_render(plan, full, identity, public, boundary_token_ids=bounds)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.policy, args.pool, args.config)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        detail = exc.errors()[0] if isinstance(exc, ValidationError) else None
        where = ".".join(str(p) for p in detail["loc"]) if detail else ""
        message = f"normalizer.{where}: {detail['msg']}" if detail else str(exc)
        print(f"kvgate normalize: bad config: {message}", file=sys.stderr)
        return 2
    raw = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)
    try:
        if len(raw) > MAX_STDIN_BYTES:
            raise ValueError("request larger than 64 MiB")
        body = orjson.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("request must be a JSON object")
    except (ValueError, orjson.JSONDecodeError) as exc:
        print(f"kvgate normalize: stdin is not one JSON request: {exc}", file=sys.stderr)
        return 2
    endpoint = args.endpoint or ("chat" if "messages" in body else "completions")
    secret_text = os.environ.get(args.secret_env)
    secret = secret_text.encode() if secret_text else DEV_SECRET
    identity = KeyIdentity(
        model_id=args.model or str(body.get("model", "")),
        weights_version=args.weights_version,
        tokenizer_version=args.tokenizer_version,
        template_version=args.template_version,
        adapter=args.adapter,
        block_size_tokens=args.block_size,
        kv_dtype=args.kv_dtype,
        namespace=args.tenant,
        epoch=args.epoch,
    )
    public = public_identity_of(identity) if args.public else None
    try:
        norm = Normalizer(config, secret)
        prompt = _canonicalize(norm, endpoint, body, identity, public, args.render_url)
    except NormalizerError as exc:
        where = f" (param {exc.param})" if exc.param else ""
        print(f"kvgate normalize: {exc.code}: {exc.message}{where}", file=sys.stderr)
        # Render mode without --render-url is the command's arguments at fault, not the request's.
        return 2 if exc.code == "render_required" else 1
    diagnostics = list(prompt.diagnostics)
    if not secret_text:
        diagnostics.append(f"secret: ${args.secret_env} not set, development secret used")
    out = {
        "endpoint": endpoint,
        "mode": config.mode,
        "zones": [
            {"zone": z.zone.value, "source": z.source, "start_token": z.start_token, "end_token": z.end_token}
            for z in prompt.zones
        ],
        "n_tokens": prompt.n_tokens,
        "block_size": prompt.block_size_tokens,
        "block_keys": [f"{k:016x}" for k in prompt.block_keys],
        "public_block_keys": [f"{k:016x}" for k in prompt.public_block_keys],
        "identity": _identity_report(identity, secret_key(secret)),
        "render_fingerprint": norm.render_fingerprint,
        "body_changed": prompt.canonical_body is not None,
        "diagnostics": diagnostics,
    }
    sys.stdout.buffer.write(orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n")
    return 0
