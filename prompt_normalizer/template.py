"""Tokenizer mode: the model's Jinja chat template plus a local HF `tokenizers` tokenizer.

The template renders in `prompt_normalizer.template_env` (the environment Hugging Face
`apply_chat_template`, and so vLLM, gives a template) with the special tokens of
`tokenizer_config.json` and the request's `chat_template_kwargs` merged into the context. Chat
prompts are encoded without adding special tokens (the template writes them), completions prompts
with them.

tokenizers and jinja2 come with the `kvgate[tokenizer]` extra and are imported when a
`ChatTemplateTokenizer` is built, never at module import: an approximate-mode process loads
neither.
"""

from __future__ import annotations

import array
import hashlib
import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from prompt_normalizer.canonical import CanonicalChat
from prompt_normalizer.chat_input import part_type
from prompt_normalizer.config import TEMPLATE_TIME_DEFAULT
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.extras import tokenizer_mode_missing
from prompt_normalizer.keys import TOKEN_DTYPE, TokenArray
from prompt_normalizer.layout import BoundarySpec, common_prefix_chars

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from prompt_normalizer.template_env import TemplateRenderer

_FORMAT_CACHE_MAX = 16
# Token ids reach numpy through a 32-bit array.array (several times faster than numpy's conversion
# of a Python list); on a platform whose C unsigned int is not 32 bits, numpy converts them.
_U32_ARRAY = array.array("I").itemsize == 4
_OPENAI_FORMAT = re.compile(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content)")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _load_tokenizer_mode(template_time: datetime) -> tuple[type[Tokenizer], TemplateRenderer]:
    """The tokenizer class and a template renderer, or a config error naming the extra."""
    try:
        from tokenizers import Tokenizer

        from prompt_normalizer.template_env import TemplateRenderer
    except ImportError as exc:
        message = tokenizer_mode_missing() or f"mode 'tokenizer' cannot import {exc.name}"
        raise NormalizerError(message, code="bad_config") from None
    return Tokenizer, TemplateRenderer(template_time)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass(frozen=True, slots=True)
class Encoded:
    """Token ids of a rendered prompt and the end character offset of each token."""

    tokens: TokenArray
    ends: npt.NDArray[np.int64] | None


class ChatTemplateTokenizer:
    """Renders chat requests with the model's template and tokenizes them exactly."""

    def __init__(
        self,
        tokenizer_dir: str,
        chat_template_file: str | None = None,
        content_format: str = "auto",
        template_time: datetime = TEMPLATE_TIME_DEFAULT,
    ) -> None:
        tokenizer_class, self._renderer = _load_tokenizer_mode(template_time)
        root = Path(tokenizer_dir)
        try:
            tok_bytes = (root / "tokenizer.json").read_bytes()
            self._tokenizer: Tokenizer = tokenizer_class.from_str(tok_bytes.decode())
            config_path = root / "tokenizer_config.json"
            config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise NormalizerError(
                f"cannot load tokenizer from {tokenizer_dir}: {exc}", code="bad_config"
            ) from None
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            templates = {str(t["name"]): str(t["template"]) for t in raw if isinstance(t, dict)}
        jinja_file = root / "chat_template.jinja"
        if chat_template_file:
            templates = {"default": Path(chat_template_file).read_text()}
        elif not templates and jinja_file.exists():
            templates["default"] = jinja_file.read_text()
        if "default" not in templates:
            raise NormalizerError(f"no chat template in {tokenizer_dir}", code="bad_config")
        self._templates = templates
        self._special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        self._content_format = content_format
        self._lock = threading.Lock()
        self._auto_formats: dict[str, str] = {}
        digest = hashlib.sha256(tok_bytes)
        for name in sorted(templates):
            digest.update(name.encode() + b"\0" + templates[name].encode() + b"\0")
        self.fingerprint = digest.hexdigest()[:16]

    def _source(self, chat: CanonicalChat) -> str:
        override = chat.template.get("chat_template")
        if isinstance(override, str):
            return override
        if chat.tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        return self._templates["default"]

    def _messages(self, chat: CanonicalChat, source: str, n: int) -> list[dict[str, Any]]:
        fmt = self._content_format
        if fmt == "auto":
            fmt = self._auto_formats.get(source, "")
            if not fmt:  # a regex over the whole template: once per template, not per render
                fmt = "openai" if _OPENAI_FORMAT.search(source) else "string"
                with self._lock:
                    if len(self._auto_formats) >= _FORMAT_CACHE_MAX:
                        self._auto_formats.clear()
                    self._auto_formats[source] = fmt
        out = []
        for msg in chat.messages[:n]:
            content = msg.get("content")
            if isinstance(content, list):
                msg = dict(msg)
                if fmt == "string":
                    msg["content"] = "\n".join(p["text"] for p in content if p.get("type") == "text")
                else:
                    msg["content"] = [p if p.get("type") == "text" else _media_part(p) for p in content]
            out.append(msg)
        return out

    def render(self, chat: CanonicalChat, spec: BoundarySpec | None = None) -> str:
        """The prompt text (or, with `spec`, the text of one boundary prefix)."""
        source = self._source(chat)
        n = len(chat.messages) if spec is None else spec.n_messages
        with_tools = chat.tools is not None if spec is None else spec.with_tools
        add_gen = chat.add_generation_prompt and not chat.continue_final_message if spec is None else False
        context: dict[str, Any] = dict(self._special)
        context.update(chat.template.get("chat_template_kwargs") or {})
        context.update(
            messages=self._messages(chat, source, n),
            tools=list(chat.tools) if with_tools and chat.tools else None,
            documents=chat.template.get("documents"),
            add_generation_prompt=add_gen,
        )
        text = self._renderer.render(source, context)
        if spec is None and chat.continue_final_message:
            text = _cut_after_final(text, chat.messages[-1].get("content"))
        return text

    def encode(self, text: str, *, add_special_tokens: bool, with_offsets: bool) -> Encoded:
        enc = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if _U32_ARRAY:
            tokens = np.frombuffer(array.array("I", enc.ids), dtype=np.uintc).astype(TOKEN_DTYPE, copy=False)
        else:
            tokens = np.array(enc.ids, dtype=TOKEN_DTYPE)
        ends = None
        if with_offsets:
            ends = np.frombuffer(array.array("q", [end for _, end in enc.offsets]), dtype=np.int64)
            # Special tokens added by a post-processor report (0, 0); keep ends non-decreasing.
            ends = np.maximum.accumulate(ends) if ends.size else ends
        return Encoded(tokens, ends)

    def boundary_tokens(
        self, chat: CanonicalChat, full_text: str, ends: npt.NDArray[np.int64], specs: Sequence[BoundarySpec]
    ) -> list[int | None]:
        """Token positions of boundary prefixes: common text prefix, mapped through token offsets."""
        out: list[int | None] = []
        for spec in specs:
            if spec.n_messages == 0 and not spec.with_tools:
                out.append(0)
                continue
            try:
                prefix = self.render(chat, spec)
            except NormalizerError:
                out.append(None)
                continue
            chars = common_prefix_chars(full_text, prefix)
            out.append(int(np.searchsorted(ends, chars, side="right")))
        return out


# The modality vLLM gives a media part in the messages of an "openai"-format template (`{"type":
# "image"}`, ...: `parse_chat_message_content_part`), by part type: `input_audio` is audio, as a
# template that looks for `content.type == "audio"` must see it. Any other type renders as the
# first word of its name.
_MODALITIES = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}


def _media_part(part: dict[str, Any]) -> dict[str, Any]:
    ptype = part_type(part)
    return {"type": _MODALITIES.get(ptype) or ptype.split("_")[0]}


def _cut_after_final(text: str, content: Any) -> str:
    if isinstance(content, list):
        texts = [p["text"] for p in content if p.get("type") == "text"]
        content = texts[-1] if texts else ""
    final = str(content or "").strip()
    where = text.rfind(final) if final else -1
    if where < 0:
        raise NormalizerError(
            "continue_final_message: final message not found in the rendered prompt", param="messages"
        )
    return text[: where + len(final)]
