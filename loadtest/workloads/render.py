"""Turn a request's prompt into the exact bytes a worker tokenizes (the emulator: one token per byte).

`BlockPrompt` and `TextPrompt` go to `/v1/completions` untouched, so their byte count is their token
count. `ChatPrompt` goes through a chat template, which adds role markers and tool schemas; the
simulator uses the same renderer the emulated worker uses (passed in as `chat_renderer`), so token
counts agree between the simulator and the HTTP benchmark.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from loadtest.workloads.records import BlockPrompt, ChatPrompt, Prompt, TextPrompt, WorkloadRequest
from loadtest.workloads.text import block_bytes, synth_bytes

ChatRenderer = Callable[[ChatPrompt], bytes]


def block_prompt_bytes(prompt: BlockPrompt, tail_key: str) -> bytes:
    """Concatenated block texts, the last block cut to fit, then the request's own unhashed tail."""
    size = prompt.block_size_tokens
    parts: list[bytes] = []
    remaining = prompt.n_tokens
    for block_id in prompt.block_ids:
        take = min(size, remaining)
        full = block_bytes(prompt.salt, block_id, size)
        parts.append(full if take == size else full[:take])
        remaining -= take
    if remaining > 0:
        parts.append(synth_bytes(f"tail\x1f{prompt.salt}\x1f{tail_key}", remaining))
    return b"".join(parts)


def plain_chat_template(prompt: ChatPrompt) -> bytes:
    """A minimal deterministic template: `<|role|>\\ncontent\\n` per message, tools first, then the
    generation prompt. Used when no worker-side renderer is given."""
    out: list[str] = []
    if prompt.tools_json:
        out.append("<|tools|>\n" + "\n".join(prompt.tools_json) + "\n")
    for m in prompt.messages:
        body = m.content
        if m.tool_calls:
            calls = [{"id": c.call_id, "name": c.name, "arguments": c.arguments_json} for c in m.tool_calls]
            body += json.dumps(calls, separators=(",", ":"))
        out.append(f"<|{m.role}|>\n{body}\n")
    out.append("<|assistant|>\n")
    return "".join(out).encode()


def prompt_bytes(req: WorkloadRequest, chat_renderer: ChatRenderer = plain_chat_template) -> bytes:
    """The model input of `req` as bytes."""
    prompt: Prompt = req.prompt
    if isinstance(prompt, BlockPrompt):
        return block_prompt_bytes(prompt, req.request_id)
    if isinstance(prompt, TextPrompt):
        return prompt.text.encode()
    return chat_renderer(prompt)
