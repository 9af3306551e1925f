"""The part an attempt plays in its request (`outcome.Attempt.leg`): all of it, or one leg of a
prefill/decode split. The leg, not the worker's configured role, says which of a request's
attempts compare (`outcome.HeldVerdicts.alone`): a mixed worker plays either leg of a vLLM split,
and in a `holder_prefill` pool every worker is mixed."""

from __future__ import annotations

import enum


class Leg(enum.Enum):
    """An attempt's part: `WHOLE` (the request on one worker, in any pool), or a split's
    `PREFILL` leg (computes the prompt's KV, answers nothing) or `DECODE` leg (the answer)."""

    WHOLE = "whole"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def answers(self) -> bool:
        """Whether the client's answer comes from this part: a whole attempt's, a decode leg's."""
        return self is not Leg.PREFILL
