"""The normalizer's answer for an admitted request, in its pool's mode.

A route with a prompt is canonicalized (approximate on the event loop, tokenizer mode on the
normalizer's thread, render mode through a worker's render endpoint); a pass-through route has
nothing to key, and is sized from its body so that quotas and load accounting still see it.
`Keying` holds what this takes: each pool's normalizer, the key identities, the normalizer's
thread and the upstream clients.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.auth import Tenant
from gateway.bodies import missing_model
from gateway.config import LimitsConfig
from gateway.config.pool import PoolConfig
from gateway.errors import ApiError
from gateway.keying_pool import FairSlots, KeyingPool, Turns, rebuild, run_fairly
from gateway.large_body import BodyJob, ModelKeying
from gateway.registry import Pool
from gateway.render import render_canonical
from gateway.routes import ROUTES, ApiRoute
from gateway.transport import Transport
from policies.identity import derive_secret, key_identities, served_identity
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import PUBLIC_NAMESPACE, CanonicalPrompt, KeyIdentity

# Canonicalizations on the keying's thread or queued for it at once (`Keying.thread_slots`).
THREAD_JOBS = 2


class Keying:
    """Each pool's normalizer and the key identities of its (model, tenant) pairs, plus the one
    thread tokenizer-mode canonicalization runs on and the upstream clients render mode asks a
    worker through.

    This is the one holder of the normalizers: a policy reload that changes the policy file's
    normalizer settings rebuilds them here (`set_policy_normalizer`), which also forgets the
    identities (they carry the normalizer's render fingerprint)."""

    __slots__ = (
        "_executor",
        "_identities",
        "_pools",
        "_secret",
        "normalizers",
        "processes",
        "thread_slots",
        "transport",
    )

    def __init__(
        self,
        pools: Sequence[PoolConfig],
        policy_normalizer: NormalizerConfig,
        secret: bytes,
        transport: Transport,
    ) -> None:
        self._pools = pools
        self._secret = secret
        self.transport = transport
        self.normalizers = build_normalizers(pools, policy_normalizer, secret, {})
        self._identities: dict[tuple[str, str], tuple[KeyIdentity, KeyIdentity | None]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # The thread's work, handed out fairly across tenants: one canonicalization at work, the
        # next one queued behind it.
        self.thread_slots = FairSlots(THREAD_JOBS)
        self.processes = KeyingPool()

    def normalizer(self, pool: Pool) -> Normalizer:
        return self.normalizers[pool.name]

    def identities(self, pool: Pool, model: str, tenant: Tenant) -> tuple[KeyIdentity, KeyIdentity | None]:
        """The key identity of a (model, tenant) and, unless the tenant is strict, its public twin
        (`policies.identity.key_identities`)."""
        cached = self._identities.get((model, tenant.name))
        if cached is not None:
            return cached
        found = key_identities(self.base_identity(pool, model), tenant)
        self._identities[(model, tenant.name)] = found
        return found

    def base_identity(self, pool: Pool, model: str) -> KeyIdentity:
        """The identity of served model id `model` (with its LoRA adapter, if it names one) in the
        public namespace (`policies.identity.served_identity`)."""
        return served_identity(self.deployment_identity(pool), model, pool.config.adapters.get(model, ""))

    def deployment_identity(self, pool: Pool) -> KeyIdentity:
        """The pool's base model with every field of the pool's `identity` section, which are all
        bound into the keys; what a KV event without `lora_name` was computed under."""
        ident = pool.config.identity
        normalizer = self.normalizers[pool.name]
        return KeyIdentity(
            model_id=base_model(pool),
            weights_version=ident.weights_version,
            tokenizer_version=ident.tokenizer_version or (normalizer.render_fingerprint or ""),
            template_version=ident.template_version,
            block_size_tokens=pool.config.block_size_tokens,
            kv_dtype=ident.kv_dtype,
            namespace=PUBLIC_NAMESPACE,
            epoch=ident.epoch,
        )

    def set_policy_normalizer(self, policy_normalizer: NormalizerConfig) -> None:
        """Rebuild the normalizers that follow the policy file (a reloaded policy's settings)."""
        self.normalizers = build_normalizers(self._pools, policy_normalizer, self._secret, self.normalizers)
        self._identities.clear()

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """One thread for canonicalization off the event loop: tokenizer mode, and large bodies
        in approximate mode (made on first use, shut at lifespan end)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvgate-normalizer")
        return self._executor

    def close_executor(self) -> None:
        """Stop the keying's thread and its keying process (lifespan end)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self.processes.close()

    def large_body_job(
        self, raw: bytes, api: ApiRoute, models: Mapping[str, Pool], tenant: Tenant, limits: LimitsConfig
    ) -> BodyJob:
        """What the keying process needs to read `raw` (within `limits`) and key it for any model
        whose pool keys in approximate mode (under `tenant`'s identities)."""
        keyed: dict[str, ModelKeying] = {}
        for model, pool in models.items():
            normalizer = self.normalizers[pool.name]
            if normalizer.config.mode == "approximate":
                identity, public = self.identities(pool, model, tenant)
                keyed[model] = ModelKeying(normalizer.config, identity, public)
        only = next(iter(models)) if len(models) == 1 else None
        secret = derive_secret(self._secret, "prefix_keys")
        return BodyJob(raw, api.path, limits.max_choices, secret, keyed, only, limits.max_pooling_inputs)


def base_model(pool: Pool) -> str:
    """The pool's first model id that is not a LoRA adapter."""
    adapters = pool.config.adapters
    return next((m for m in pool.config.models if m not in adapters), pool.config.models[0])


def build_normalizers(
    pools: Sequence[PoolConfig],
    policy_normalizer: NormalizerConfig,
    secret: bytes,
    current: Mapping[str, Normalizer],
) -> dict[str, Normalizer]:
    """One normalizer per pool: the pool's own settings, else the policy file's. An unchanged
    config keeps its normalizer (and its drift memory)."""
    normalizer_secret = derive_secret(secret, "prefix_keys")
    out: dict[str, Normalizer] = {}
    for pool in pools:
        wanted = pool.normalizer if pool.normalizer is not None else policy_normalizer
        existing = current.get(pool.name)
        out[pool.name] = (
            existing
            if existing is not None and existing.config == wanted
            else Normalizer(wanted, normalizer_secret)
        )
    return out


# Bodies up to this size are read and canonicalized on the event loop in approximate mode (a
# millisecond or less for a common request), larger ones in the keying process
# (`read_large_body`); so are smaller ones of more than `INLINE_MAX_OBJECTS` JSON objects, whose
# cost is in their count (5-15 µs each: thousands of tiny messages, parts or tool calls held the
# loop for up to 35 ms; docs/reliability.md, "Many content parts"). A body's braces are counted
# (with numpy: 10 µs for 64 KiB, 40 µs for 256 KiB, against 0.18 ms for `bytes.count`) only past
# `_COUNT_FROM_BYTES`: below it there is no room for so many objects to cost much.
INLINE_PROMPT_BYTES = 256 * 1024
INLINE_MAX_OBJECTS = 1024
_COUNT_FROM_BYTES = 16 * 1024
_BRACE = ord("{")


def keyed_apart(raw: bytes) -> bool:
    """Whether a JSON body is read and keyed in the keying process rather than on the loop: over
    `INLINE_PROMPT_BYTES`, or over `INLINE_MAX_OBJECTS` objects (braces, those in strings too)."""
    size = len(raw)
    if size <= _COUNT_FROM_BYTES:
        return False
    if size > INLINE_PROMPT_BYTES:
        return True
    return int(np.count_nonzero(np.frombuffer(raw, np.uint8) == _BRACE)) > INLINE_MAX_OBJECTS


@dataclass(frozen=True, slots=True)
class LargeBody:
    """A large JSON body as admission reads it (`parse_body`, the route it picks, `encode_body`),
    and, when its model's pool keys in approximate mode, its `CanonicalPrompt` for `model` or the
    400 the normalizer gives it (`prompt_error`)."""

    api: ApiRoute
    body: dict[str, Any]
    encoded: bytes
    model: str | None = None
    canonical: CanonicalPrompt | None = None
    prompt_error: ApiError | None = None


async def read_large_body(
    raw: bytes,
    api: ApiRoute,
    keying: Keying,
    models: Mapping[str, Pool],
    tenant: Tenant,
    limits: LimitsConfig,
) -> LargeBody | None:
    """A JSON body that is `keyed_apart` read and keyed in the keying process, the loop taking
    turns while it rebuilds the parsed body; the same answers as admission's own calls (a 400 is
    raised). None when the keying process died meanwhile: the caller reads the body itself."""
    job = keying.large_body_job(raw, api, models, tenant, limits)
    keyed = await keying.processes.key(job, tenant.name)
    if keyed is None:
        return None
    if keyed.error is not None:
        status, message, type_, code, param = keyed.error
        raise ApiError(status, message, type_, code, param)
    assert keyed.body is not None
    turns = Turns()
    body = await rebuild(keyed.body, turns)
    out = LargeBody(ROUTES[keyed.path], body, keyed.encoded)
    model = keyed.model
    if model is None:
        return out
    if keyed.prompt_error is not None:
        message, code, param = keyed.prompt_error
        error = prompt_error(NormalizerError(message, param=param, code=code))
        return dataclasses.replace(out, model=model, prompt_error=error)
    canonical = keyed.canonical
    if canonical is None:
        return out
    if keyed.canonical_body is not None:
        canonical = dataclasses.replace(canonical, canonical_body=await rebuild(keyed.canonical_body, turns))
    if keyed.pending is not None:
        canonical = keying.normalizers[models[model].name].observe_pending(canonical, keyed.pending)
    return dataclasses.replace(out, model=model, canonical=canonical)


async def canonical_prompt(
    api: ApiRoute,
    raw: bytes,
    body: dict[str, Any],
    keying: Keying,
    pool: Pool,
    identity: KeyIdentity,
    public: KeyIdentity | None,
    request_id: str,
    tenant: str,
) -> CanonicalPrompt:
    """Keys, zones and size of one request; 400 on a prompt the normalizer cannot read. A render
    answer is read within `tenant`'s share of the process's answer budget."""
    normalizer = keying.normalizers[pool.name]
    prompt = api.prompt
    if prompt is None:
        # Nothing to key: the policy routes on load. JSON inputs count as approximate tokens of
        # their body; an audio file counts for nothing (its cost is not in tokens).
        n_tokens = 0 if api.multipart else len(raw) // normalizer.config.chars_per_token
        return CanonicalPrompt(n_tokens, pool.config.block_size_tokens, (), ())
    try:
        if normalizer.config.mode == "render":
            try:
                plan = normalizer.prepare_render(prompt, body)
            except NormalizerError as exc:
                if exc.code != "render_empty":
                    raise
                return normalizer.canonicalize(prompt, body, identity, public)  # nothing to render
            session = keying.transport.upstream()
            answers = keying.transport.answers.share(tenant)
            return await render_canonical(
                normalizer, plan, pool, session, identity, public, request_id, answers
            )
        if normalizer.config.mode == "tokenizer" or keyed_apart(raw):
            # Tokenizing and templating a long prompt takes milliseconds, and approximate mode
            # spends up to ~0.1 s a MB on a large body: off the event loop, on the keying's one
            # thread, so large bodies take their turns there instead of holding every request,
            # and tenants take theirs in fair order.
            return await run_fairly(
                keying.thread_slots,
                tenant,
                keying.executor(),
                functools.partial(normalizer.canonicalize, prompt, body, identity, public),
            )
        return normalizer.canonicalize(prompt, body, identity, public)
    except NormalizerError as exc:
        raise prompt_error(exc) from None


def prompt_error(exc: NormalizerError) -> ApiError:
    """A prompt the normalizer cannot read: 400, naming the field."""
    return ApiError(400, exc.message, "invalid_request_error", exc.code, exc.param)


def only_model(models: Mapping[str, Pool]) -> str:
    """The model of a request that names none: the gateway's only one (as vLLM takes its own)."""
    served = list(models)
    if len(served) != 1:
        raise missing_model(served)
    return served[0]
