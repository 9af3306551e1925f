"""A tiny real model directory for tests: a byte-level BPE trained here and a ChatML-style template
that renders tools in the system turn and tool calls in assistant turns."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages and messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if not (loop.first and message.role == 'system') %}
<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CORPUS = [
    "You are a careful assistant. Use the tools when they help.",
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}',
    "What is the weather in Paris today? It is sunny and 21 degrees.",
    "The quick brown fox jumps over the lazy dog. 0123456789 {}[]:,\"'",
] * 20


def build_tiny_model(directory: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE on a small corpus and save it with the chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE,
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
