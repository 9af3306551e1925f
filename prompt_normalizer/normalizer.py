"""The normalizer facade the gateway and the simulator call.

    norm = Normalizer(config, secret)
    prompt = norm.canonicalize("chat", body, identity, public_identity)        # approximate, tokenizer
    plan = norm.prepare_render("chat", body)                                   # render mode: the gateway
    prompt = norm.from_render(plan, token_ids, identity, public_identity,      # POSTs plan.body (and the
                              boundary_token_ids=[...])                        # boundary bodies) first

Endpoints: `chat`, `completions`, and the APIs a worker converts to chat, `responses` (OpenAI
Responses) and `messages` (Anthropic Messages), keyed through their input adapters as the chat
request the worker renders (`converted.py`).

`canonicalize` is pure CPU work except for the bounded drift memory. In `render` mode it accepts only
completions prompts given as token ids; any other request raises `NormalizerError(code=
"render_required")`, because its token ids come from the worker: the gateway calls the worker's
render endpoint with `plan.body` and hands the ids to `from_render`, a pure function of the plan
and the ids. In every mode, when `CanonicalPrompt.canonical_body` is set the gateway forwards that
body instead of the original, so the worker caches exactly what the keys describe.

`keys_for_tokens` gives the same chained keys for raw token ids (KV events carry token ids), so an
index fed by events and one fed by requests agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from prompt_normalizer.approx import APPROX_UNIT, approx_chat, approx_text
from prompt_normalizer.canonical import CanonicalChat, ChatRules, canonicalize_chat
from prompt_normalizer.chat_input import request_flag
from prompt_normalizer.completions import CompletionsPrompt
from prompt_normalizer.config import NormalizerConfig, VolatileRule, ZoneConfig
from prompt_normalizer.converted import ConvertedChat, converted_canonical, no_edit_rules, relabel_drift
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.generate_input import generate_as_completions
from prompt_normalizer.keys import (
    TOKEN_DTYPE,
    TOKEN_UNIT,
    IdentityTokenHasher,
    PrefixKeyMemo,
    TokenArray,
    as_tokens,
    public_identity_of,
    secret_key,
    token_block_keys,
)
from prompt_normalizer.layout import (
    Boundaries,
    Hashed,
    assemble,
    boundaries_from_positions,
    boundary_body,
    boundary_specs,
    drift_line,
)
from prompt_normalizer.messages_input import messages_chat
from prompt_normalizer.render import CHAT_RENDER_PATH, COMPLETIONS_RENDER_PATH, RenderPlan, render_boundaries
from prompt_normalizer.responses_input import responses_chat
from prompt_normalizer.roots import RootCache, UnitRoots
from prompt_normalizer.sessions import DeferredDrift, PendingDrift, SessionDrift
from prompt_normalizer.switches import json_copy
from prompt_normalizer.template import ChatTemplateTokenizer
from prompt_normalizer.types import BlockKey, CanonicalPrompt, KeyIdentity

__all__ = [
    "Endpoint",
    "Normalizer",
    "NormalizerConfig",
    "NormalizerError",
    "VolatileRule",
    "ZoneConfig",
    "public_identity_of",
]

Endpoint = Literal["chat", "completions", "responses", "messages", "generate"]
# The input adapters of the APIs a worker serves by converting them to chat.
_CONVERTERS: dict[str, Callable[[Mapping[str, Any]], ConvertedChat]] = {
    "responses": responses_chat,
    "messages": messages_chat,
}


class Normalizer:
    """Turns one OpenAI request body into a `CanonicalPrompt` under a `KeyIdentity`."""

    def __init__(self, config: NormalizerConfig, secret: bytes, *, defer_drift: bool = False) -> None:
        """`defer_drift`: keep no session memory; each request's drift observation is taken with
        `take_pending_drift` and made by another normalizer of the same config and secret
        (`observe_pending`), one that keeps the memory. Such a normalizer keys one request at a
        time."""
        self._config = config
        # Per-config work done once, not per request.
        self._chat_rules = ChatRules.of(config)
        self._converted_rules = no_edit_rules(self._chat_rules)
        self._chars_per_token = config.chars_per_token
        self._key = secret_key(secret)
        self._roots = RootCache(self._key)
        self._memo = PrefixKeyMemo(self._key)
        self._tokenizer: ChatTemplateTokenizer | None = None
        if config.mode == "tokenizer":
            assert config.tokenizer_dir is not None  # checked by the config
            self._tokenizer = ChatTemplateTokenizer(
                config.tokenizer_dir, config.chat_template_file, config.content_format, config.template_time
            )
        self._session_fields = frozenset(config.session_fields)
        self._deferred = DeferredDrift(config, self._key) if defer_drift else None
        self._sessions: SessionDrift = (
            self._deferred if self._deferred is not None else SessionDrift(config, self._key)
        )

    @property
    def config(self) -> NormalizerConfig:
        return self._config

    @property
    def chat_tokenizer(self) -> ChatTemplateTokenizer | None:
        """The local template + tokenizer (tokenizer mode), e.g. to time its stages."""
        return self._tokenizer

    @property
    def render_fingerprint(self) -> str | None:
        """A digest of the local tokenizer and template (tokenizer mode): put it in the identity's
        `tokenizer_version` / `template_version` when the pool config does not name versions."""
        return self._tokenizer.fingerprint if self._tokenizer is not None else None

    @property
    def drift_sessions(self) -> int:
        return len(self._sessions)

    def root(self, identity: KeyIdentity, unit: str = TOKEN_UNIT) -> int:
        """The chain root for `identity` (cached, bounded)."""
        return self._roots.root(identity, unit)

    def keys_for_tokens(
        self, token_ids: Sequence[int] | TokenArray, identity: KeyIdentity, parent: BlockKey | None = None
    ) -> tuple[BlockKey, ...]:
        """Chained keys of raw token ids, from the identity root or from a parent block's key."""
        seed = self.root(identity) if parent is None else int(parent)
        return token_block_keys(as_tokens(token_ids), identity.block_size_tokens, seed)

    def token_hasher(self, identity: KeyIdentity) -> IdentityTokenHasher:
        """A hasher for KV-event token ids whose keys equal this normalizer's request keys
        (matches the `TokenBlockHasher` protocol of `policies.kv_feed` structurally)."""
        return IdentityTokenHasher(self.root, identity)

    def session_digest(
        self, body: Mapping[str, Any], identity: KeyIdentity, session_key: str | None = None
    ) -> bytes | None:
        """Keyed session id: a header value if given, else the first configured body field."""
        return self._sessions.digest(body, identity, session_key)

    def take_pending_drift(self) -> PendingDrift | None:
        """The drift observation of the last request a deferring normalizer keyed, if it named a
        session (once)."""
        return self._deferred.take() if self._deferred is not None else None

    def observe_pending(self, prompt: CanonicalPrompt, pending: PendingDrift) -> CanonicalPrompt:
        """`prompt`, keyed by a deferring normalizer, with the drift report this normalizer's
        session memory gives it: the same answer as keying it here."""
        drift = self._sessions.observe_pending(pending, prompt.block_keys)
        diagnostics = prompt.diagnostics
        if drift.first_diff_block is not None:
            diagnostics = (*diagnostics, drift_line(drift))
        observed = dataclasses.replace(prompt, drift=drift, diagnostics=diagnostics)
        return observed if pending.sources is None else relabel_drift(observed, pending.sources)

    # -- the facade -------------------------------------------------------------------------------

    def canonicalize(
        self,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        identity: KeyIdentity,
        public_identity: KeyIdentity | None = None,
        *,
        session_key: str | None = None,
    ) -> CanonicalPrompt:
        """Canonical model input, zones and keys of one request (approximate and tokenizer modes).

        `public_identity`, when given, asks for `public_block_keys`; they are always computed under
        `public_identity_of(identity)`, and a `public_identity` that differs from it raises
        `NormalizerError(code="bad_identity")`.
        """
        if type(body) is not dict and not isinstance(body, Mapping):  # the ABC check is the slow one
            raise NormalizerError("request body must be a JSON object")
        mode = self._config.mode
        prompt_body, field = body, "prompt"
        if endpoint == "generate":
            prompt_body, field = generate_as_completions(body)
            endpoint = "completions"
            if mode == "render":
                mode = "approximate"  # no worker renders a native prompt: its text is keyed by characters
        if endpoint == "completions":
            try:
                prompt = CompletionsPrompt(prompt_body, self._config.max_input_chars)
            except NormalizerError as exc:
                exc.param = field if exc.param == "prompt" else exc.param
                raise
            text_unit = APPROX_UNIT if mode == "approximate" else TOKEN_UNIT
            roots = self._roots.unit_roots(
                identity, public_identity, TOKEN_UNIT if prompt.tokens is not None else text_unit
            )
            diagnostics = tuple(prompt.diagnostics)
            if prompt.tokens is not None:
                hashed = _token_bytes(prompt.tokens)
                return self._finish(
                    hashed, roots, identity, body, session_key, None, None, diagnostics, field
                )
            assert prompt.text is not None
            if mode == "approximate":
                hashed = approx_text(prompt.text, self._chars_per_token)
                return self._finish(
                    hashed, roots, identity, body, session_key, None, None, diagnostics, field
                )
            if mode == "render":
                raise NormalizerError(
                    "render mode: call prepare_render() and from_render()", code="render_required"
                )
            assert self._tokenizer is not None
            add_special = request_flag(
                prompt_body, "add_special_tokens", self._config.completions_add_special_tokens
            )
            enc = self._tokenizer.encode(prompt.text, add_special_tokens=add_special, with_offsets=False)
            hashed = _token_bytes(enc.tokens)
            return self._finish(hashed, roots, identity, body, session_key, None, None, diagnostics, field)
        converter = None if endpoint == "chat" else _CONVERTERS.get(endpoint)
        if converter is None and endpoint != "chat":
            raise NormalizerError(f"unknown endpoint {endpoint!r}", code="bad_endpoint")
        if converter is not None:
            return self._converted(converter(body), body, identity, public_identity, session_key)
        if mode == "render":
            raise NormalizerError(
                "render mode: call prepare_render() and from_render()", code="render_required"
            )
        chat = canonicalize_chat(body, self._chat_rules, self._key)
        if mode == "approximate":  # the common request, without a call of its own
            hashed, bounds = approx_chat(chat, self._chars_per_token)
            roots = self._roots.unit_roots(identity, public_identity, APPROX_UNIT)
            return self._finish(hashed, roots, identity, body, session_key, chat, bounds)
        return self._tokenized(chat, body, identity, public_identity, session_key)

    def _converted(
        self,
        converted: ConvertedChat,
        body: Mapping[str, Any],
        identity: KeyIdentity,
        public_identity: KeyIdentity | None,
        session_key: str | None,
    ) -> CanonicalPrompt:
        """A Responses or Messages request, keyed as the chat request the worker renders. A
        follow-up with nothing to key before its stored turns has an empty prompt in every mode
        (render mode has nothing to ask the worker)."""
        if not converted.body["messages"]:
            unit = APPROX_UNIT if self._config.mode == "approximate" else TOKEN_UNIT
            roots = self._roots.unit_roots(identity, public_identity, unit)
            empty = approx_text("", self._chars_per_token)
            return self._finish(empty, roots, identity, body, session_key, None, None, converted.diagnostics)
        if self._config.mode == "render":
            raise NormalizerError(
                "render mode: call prepare_render() and from_render()", code="render_required"
            )
        chat = converted_canonical(converted, self._converted_rules, self._key)
        if self._config.mode == "approximate":
            hashed, bounds = approx_chat(chat, self._chars_per_token)
            roots = self._roots.unit_roots(identity, public_identity, APPROX_UNIT)
            prompt = self._finish(hashed, roots, identity, body, session_key, chat, bounds)
        else:
            prompt = self._tokenized(chat, body, identity, public_identity, session_key)
        if self._deferred is not None and self._deferred.pending is not None:
            self._deferred.pending = dataclasses.replace(self._deferred.pending, sources=converted.sources)
        return relabel_drift(prompt, converted.sources)

    def _tokenized(
        self,
        chat: CanonicalChat,
        body: Mapping[str, Any],
        identity: KeyIdentity,
        public_identity: KeyIdentity | None,
        session_key: str | None,
    ) -> CanonicalPrompt:
        """Keys and zones of a canonical chat request in tokenizer mode."""
        assert self._tokenizer is not None
        roots = self._roots.unit_roots(identity, public_identity, TOKEN_UNIT)
        text = self._tokenizer.render(chat)
        specs = boundary_specs(chat)
        needs_offsets = any(s.n_messages or s.with_tools for s in specs)
        enc = self._tokenizer.encode(
            text, add_special_tokens=chat.add_special_tokens, with_offsets=needs_offsets
        )
        n = len(enc.tokens)
        positions: list[int | None] = [0] * len(specs)
        if enc.ends is not None:
            positions = self._tokenizer.boundary_tokens(chat, text, enc.ends, specs)
        bounds = boundaries_from_positions(
            specs, positions, n, chat.add_generation_prompt, chat.volatile_index is not None
        )
        return self._finish(_token_bytes(enc.tokens), roots, identity, body, session_key, chat, bounds)

    def prepare_render(self, endpoint: Endpoint, body: Mapping[str, Any]) -> RenderPlan:
        """Render mode, step 1: the canonical body to render and forward, and the boundary renders."""
        if not isinstance(body, Mapping):
            raise NormalizerError("request body must be a JSON object")
        if endpoint == "generate":
            raise NormalizerError(
                "native generate prompts are not rendered; call canonicalize()", code="render_empty"
            )
        if endpoint == "completions":
            CompletionsPrompt(body, self._config.max_input_chars)  # validates
            return RenderPlan(
                "completions", COMPLETIONS_RENDER_PATH, json_copy(dict(body), "prompt"), (), (), None
            )
        converter = _CONVERTERS.get(endpoint)
        canonical: dict[str, Any] | None
        if converter is not None:
            # The worker renders the converted chat request; the client's body is what it receives.
            converted = converter(body)
            if not converted.body["messages"]:
                # Nothing to render: `canonicalize` gives its (empty) prompt in render mode too.
                raise NormalizerError("nothing to render; call canonicalize()", code="render_empty")
            chat = converted_canonical(converted, self._converted_rules, self._key)
            canonical = {"model": body.get("model"), **converted.body}
        elif endpoint != "chat":
            raise NormalizerError(f"unknown endpoint {endpoint!r}", code="bad_endpoint")
        else:
            chat = canonicalize_chat(body, self._chat_rules, self._key)
            canonical = chat.body
        if canonical is None or converter is not None:
            canonical = json_copy(dict(canonical if canonical is not None else body), "messages")
            # The plan outlives this call, and canonicalize_chat may read flat messages in place:
            # the plan's chat holds the private copies (equal to them), never the caller's objects.
            chat = dataclasses.replace(chat, messages=tuple(canonical["messages"]))
        specs = boundary_specs(chat)
        bodies = tuple(boundary_body(canonical, spec) for spec in specs)
        return RenderPlan("chat", CHAT_RENDER_PATH, canonical, specs, bodies, chat)

    def from_render(
        self,
        plan: RenderPlan,
        token_ids: Sequence[int] | TokenArray,
        identity: KeyIdentity,
        public_identity: KeyIdentity | None = None,
        *,
        boundary_token_ids: Sequence[Sequence[int] | TokenArray | None] = (),
        session_key: str | None = None,
    ) -> CanonicalPrompt:
        """Render mode, step 2 (pure): keys and zones from the worker's token ids.

        `boundary_token_ids[i]` are the ids rendered for `plan.boundary_bodies[i]` (or None if not
        rendered). Missing boundaries leave the immutable zone empty and no volatile span.
        """
        tokens = as_tokens(token_ids, param="render.token_ids")
        roots = self._roots.unit_roots(identity, public_identity, TOKEN_UNIT)
        hashed = _token_bytes(tokens)
        if plan.chat is None:
            return self._finish(hashed, roots, identity, plan.body, session_key, None, None, (), "prompt")
        chat = plan.chat
        positions = render_boundaries(tokens, boundary_token_ids, plan.boundary_specs)
        bounds = boundaries_from_positions(
            plan.boundary_specs,
            positions,
            len(tokens),
            chat.add_generation_prompt,
            chat.volatile_index is not None,
        )
        return self._finish(hashed, roots, identity, plan.body, session_key, chat, bounds)

    # -- shared tail --------------------------------------------------------------------------------

    def _finish(
        self,
        hashed: Hashed,
        roots: UnitRoots,
        identity: KeyIdentity,
        body: Mapping[str, Any],
        session_key: str | None,
        chat: CanonicalChat | None,
        bounds: Boundaries | None,
        diagnostics: tuple[str, ...] = (),
        source: str = "messages",
    ) -> CanonicalPrompt:
        """Keys, zones and drift of one request from what its mode rendered (the hashed bytes and
        zone boundaries; no boundaries means one append-only span)."""
        diags = [*chat.diagnostics, *diagnostics] if chat is not None else list(diagnostics)
        if bounds is None:
            bounds = Boundaries(0, hashed.n_tokens, {})
        block_size = identity.block_size_tokens
        observe = None
        # Most requests name no session: skip the method call when no session field is present.
        if session_key is not None or not self._session_fields.isdisjoint(body):
            observe = self._sessions.observer(body, identity, session_key, chat, block_size)
        return assemble(hashed, block_size, roots, bounds, chat, source, diags, self._memo, observe)


def _token_bytes(tokens: TokenArray) -> Hashed:
    return Hashed(tokens, TOKEN_DTYPE.itemsize, len(tokens))
