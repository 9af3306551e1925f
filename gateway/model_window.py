"""Each served model's context window, as its pool's workers report it on `GET /v1/models`.

vLLM's model cards carry `max_model_len` (`ModelCard`, vllm/entrypoints/openai/protocol.py), a
LoRA adapter's card the window of the model it runs on; SGLang's cards carry it too (its
`context_len`). A worker's cards are read once each time it is seen up: its first verdict up, up
again after being down, and restarted in place by its metrics (`scrape.worker_restarted`), since
a new process may run with another `--max-model-len`. The read runs on the pool's health round
(`registry.Pool.check`), never on a request's path, and is bounded: the health check's timeout
and headers, at most `MAX_MODELS_ANSWER_BYTES` read, the first `MAX_MODEL_CARDS` cards, windows
from 1 to `MAX_WINDOW_TOKENS`. Any other answer (404, not JSON, a body past the bound, a value
that is no plausible window) is a worker that reports none.

A pool's window for one of its models (`PoolWindows.max_model_len`, the one lookup admission makes):

    stated    the pool's `max_model_len`, when the operator sets it; a worker reporting a smaller
              window is logged as a warning (it refuses budgets the gateway admits)
    learned   else the smallest window its live workers report for the model, since a request may
              land on any of them; an adapter without a card of its own takes its base model's
    unknown   else none: a budget counts for at most `bodies.ASSUMED_MAX_MODEL_LEN`, none is refused

A worker's windows count from its read until it goes down or leaves the pool.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson

from gateway.config.pool import PoolConfig
from policies.base import WorkerId

log = logging.getLogger("kvgate.model_window")

# vLLM lists one card per served model and LoRA adapter, about 250 bytes each.
MAX_MODELS_ANSWER_BYTES = 256 * 1024
MAX_MODEL_CARDS = 1024
# 64M tokens, far past any served model's window: a larger value is a broken answer, not a window.
MAX_WINDOW_TOKENS = 1 << 26


@dataclass(frozen=True, slots=True)
class ModelWindows:
    """What one read of a worker's `/v1/models` found: each model id's window in tokens, and,
    when it found none because the read or the answer failed, why."""

    windows: Mapping[str, int] = field(default_factory=dict)
    problem: str | None = None


def parse_windows(raw: bytes) -> ModelWindows:
    """The windows of a `/v1/models` answer: the cards (the first `MAX_MODEL_CARDS`) whose `id`
    is a string and whose `max_model_len` an integer from 1 to `MAX_WINDOW_TOKENS`; other cards
    are skipped. A model listed twice keeps its smaller window."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return ModelWindows(problem="not JSON")
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list):
        return ModelWindows(problem="no list of model cards")
    windows: dict[str, int] = {}
    for card in cards[:MAX_MODEL_CARDS]:
        if not isinstance(card, dict):
            continue
        model, tokens = card.get("id"), card.get("max_model_len")
        if isinstance(model, str) and type(tokens) is int and 0 < tokens <= MAX_WINDOW_TOKENS:
            windows[model] = min(tokens, windows.get(model, tokens))
    return ModelWindows(windows)


async def read_windows(
    url: str, timeout_s: float, session: aiohttp.ClientSession, headers: Mapping[str, str]
) -> ModelWindows:
    """One `GET /v1/models` of the worker at `url`, bounded as the module docstring says; never
    raises for what the worker does."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    body = bytearray()
    try:
        async with session.get(url + "/v1/models", timeout=timeout, headers=headers) as resp:
            if resp.status != 200:
                return ModelWindows(problem=f"HTTP {resp.status}")
            if (resp.content_length or 0) > MAX_MODELS_ANSWER_BYTES:
                return ModelWindows(problem=f"answer larger than {MAX_MODELS_ANSWER_BYTES} bytes")
            while chunk := await resp.content.readany():
                body += chunk
                if len(body) > MAX_MODELS_ANSWER_BYTES:
                    resp.close()
                    return ModelWindows(problem=f"answer larger than {MAX_MODELS_ANSWER_BYTES} bytes")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return ModelWindows(problem=str(exc) or type(exc).__name__)
    return parse_windows(bytes(body))


class PoolWindows:
    """The context windows of one pool's models (module docstring).

    Invariant: `max_model_len` maps each of the pool's models to its stated window when the pool
    states one, else to the smallest window among the workers' reads (`note`) still counted,
    and holds no model whose window is unknown. It is replaced whole whenever a read changes,
    so admission's one lookup never sees it half built.
    """

    def __init__(self, config: PoolConfig) -> None:
        self._config = config
        self._reported: dict[WorkerId, dict[str, int]] = {}
        stated = config.max_model_len
        self.max_model_len: dict[str, int] = {} if stated is None else dict.fromkeys(config.models, stated)

    @property
    def stated(self) -> bool:
        """Whether the pool's config states the window (then no read changes `max_model_len`)."""
        return self._config.max_model_len is not None

    def reported(self, worker: WorkerId) -> Mapping[str, int] | None:
        """The windows the worker's last read reported for the pool's models; None if none."""
        return self._reported.get(worker)

    def note(self, worker: WorkerId, read: ModelWindows) -> None:
        """A read of the worker's cards: its windows for the pool's models count from now on, in
        place of any earlier read's (a read that found none: the worker counts no more)."""
        cfg = self._config
        base = cfg.base_model
        windows: dict[str, int] = {}
        for model in cfg.models:
            tokens = read.windows.get(model)
            if tokens is None and model in cfg.adapters:
                tokens = read.windows.get(base)  # an adapter runs in its base model's window
            if tokens is not None:
                windows[model] = tokens
        where = {"pool": cfg.name, "worker": worker}
        if not windows:
            log.info("worker reports no context window", extra={**where, "problem": read.problem})
        stated = cfg.max_model_len
        smaller = {m: t for m, t in windows.items() if stated is not None and t < stated}
        if smaller:
            log.warning(
                "worker's context window is smaller than its pool's max_model_len: the worker refuses "
                "budgets the gateway admits",
                extra={**where, "windows": smaller, "max_model_len": stated},
            )
        if windows:
            self._reported[worker] = windows
        else:
            self._reported.pop(worker, None)
        self._rebuild()

    def forget(self, worker: WorkerId) -> None:
        """The worker went down or left the pool: its windows count no more."""
        if self._reported.pop(worker, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        if self.stated:
            return
        learned: dict[str, int] = {}
        for windows in self._reported.values():
            for model, tokens in windows.items():
                learned[model] = min(tokens, learned.get(model, tokens))
        if learned != self.max_model_len:
            log.info("pool's context windows", extra={"pool": self._config.name, "windows": learned})
            self.max_model_len = learned
