"""The request record every workload, trace reader, simulator and benchmark shares.

A prompt is one of three shapes:
- `ChatPrompt`: OpenAI chat messages (plus tool schemas), replayed on `/v1/chat/completions`;
- `TextPrompt`: a raw completion prompt, replayed on `/v1/completions`;
- `BlockPrompt`: a trace's structure, a chain of block ids of `block_size_tokens` tokens each. Its
  text (see `loadtest.workloads.text`) is exactly `n_tokens` ASCII characters, so with the emulator's
  byte tokenizer it is exactly `n_tokens` tokens, replayed on `/v1/completions` (no chat template).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call an assistant message made (OpenAI `tool_calls[]`)."""

    call_id: str
    name: str
    arguments_json: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message; `tool_call_id` only on role "tool", `tool_calls` only on role "assistant"."""

    role: str
    content: str
    tool_call_id: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request body's model input: messages and the tool schemas (JSON text, one per tool)."""

    messages: tuple[ChatMessage, ...]
    tools_json: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A completions prompt."""

    text: str


@dataclass(frozen=True, slots=True)
class BlockPrompt:
    """A trace prompt: `n_tokens` tokens laid out as chained blocks of `block_size_tokens`.

    Block j covers tokens `[j*B, min((j+1)*B, n_tokens))`; tokens past `len(block_ids)*B` (a trace
    that hashes only full blocks) are a tail unique to this request. `salt` names the id space: two
    prompts share a block's content only when both the salt and the chain of ids up to it agree.
    The first `immutable_blocks` blocks are the immutable zone (a session's system prompt and tool
    schemas), the part a gateway may promote to a public prefix.
    """

    block_ids: tuple[int, ...]
    block_size_tokens: int
    n_tokens: int
    salt: str = ""
    immutable_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0:
            raise ValueError("block_size_tokens must be positive")
        if self.n_tokens < 0:
            raise ValueError("n_tokens must not be negative")
        if not 0 <= self.immutable_blocks <= len(self.block_ids):
            raise ValueError("immutable_blocks must be within the block ids")
        n_ids, size = len(self.block_ids), self.block_size_tokens
        # At most one block's worth of unhashed tail, and no id without a token of its own.
        if not (n_ids - 1) * size < self.n_tokens < (n_ids + 1) * size and not (n_ids == 0 == self.n_tokens):
            raise ValueError(f"{n_ids} block ids of {size} tokens cannot hold {self.n_tokens} tokens")


Prompt = ChatPrompt | TextPrompt | BlockPrompt


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload: when it arrives, who sends it, what it asks, how long it may answer.

    `session` is "" when the source has no notion of sessions (a router then gets no session key).
    `follows` names the requests whose answers this one needs before it is sent, as an agent's next
    turn needs its last one's: a closed-loop replay sends it `think_s` after the last of them has
    finished (`loadtest.simulator.loop`), an open-loop one at `arrival_s`, when the recording sent it.
    """

    request_id: str
    arrival_s: float
    tenant: str
    session: str
    prompt: Prompt
    max_output_tokens: int
    follows: tuple[str, ...] = ()
    think_s: float = 0.0

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError("arrival_s must not be negative")
        if self.think_s < 0:
            raise ValueError("think_s must not be negative")
        if self.max_output_tokens < 1:
            raise ValueError("max_output_tokens must be at least 1")


def scale_arrivals(requests: list[WorkloadRequest], rate_scale: float) -> list[WorkloadRequest]:
    """Multiply the arrival rate by `rate_scale` (divide every arrival time and think time),
    keeping the order."""
    if rate_scale <= 0:
        raise ValueError("rate_scale must be positive")
    return sorted(
        (replace(r, arrival_s=r.arrival_s / rate_scale, think_s=r.think_s / rate_scale) for r in requests),
        key=lambda r: r.arrival_s,
    )
