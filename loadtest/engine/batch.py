"""What one scheduled batch asks of the step model (`StepProfile.step_time_s`): its prefill
tokens, its decodes and the context they read, and the causal attention of its prefill chunks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.engine.sequence import Seq


@dataclass(frozen=True, slots=True)
class BatchShape:
    """A batch's step-model inputs: a decode is a request's one new token after its whole
    sequence was computed; every other scheduled chunk is prefill."""

    prefill_tokens: int
    decode_requests: int
    context_tokens: int  # decode context read (tokens in KV of the decoding requests)
    attention_pairs: float  # Σ chunk · (already computed + chunk / 2) over the prefill chunks


def batch_shape(sched: Sequence[Seq], counts: Sequence[int]) -> BatchShape:
    """The shape of the batch that schedules `counts[i]` tokens of `sched[i]`."""
    prefill_tokens = 0
    decode_reqs = 0
    ctx_tokens = 0
    pairs = 0.0
    for seq, n in zip(sched, counts, strict=True):
        if seq.generated > 0 and n == 1 and seq.computed == seq.num_tokens - 1:
            decode_reqs += 1
            ctx_tokens += seq.computed + 1
        else:
            prefill_tokens += n
            pairs += n * (seq.computed + n / 2.0)
    return BatchShape(prefill_tokens, decode_reqs, ctx_tokens, pairs)
