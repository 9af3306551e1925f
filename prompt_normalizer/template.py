"""Tokenizer mode: the model's Jinja chat template plus a local HF `tokenizers` tokenizer.

The template environment matches what Hugging Face `apply_chat_template` (and so vLLM) gives a
template: `trim_blocks`, `lstrip_blocks`, the loop-controls extension, a `tojson` filter that keeps
key order and non-ASCII text, `raise_exception`, `strftime_now` (at a fixed configured moment,
never the wall clock), the special tokens of `tokenizer_config.json`, and `chat_template_kwargs`
merged into the context. Chat prompts are encoded without adding special tokens (the template
writes them), completions prompts with them.
"""

from __future__ import annotations

import array
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from prompt_normalizer.canonical import CanonicalChat
from prompt_normalizer.config import TEMPLATE_TIME_DEFAULT
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import TOKEN_DTYPE, TokenArray
from prompt_normalizer.layout import BoundarySpec, common_prefix_chars

_TEMPLATE_CACHE_MAX = 16
# Token ids reach numpy through a 32-bit array.array (several times faster than numpy's conversion
# of a Python list); on a platform whose C unsigned int is not 32 bits, numpy converts them.
_U32_ARRAY = array.array("I").itemsize == 4
_OPENAI_FORMAT = re.compile(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content)")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_at(moment: datetime) -> Callable[[str], str]:
    # Templates that print "today" would put the wall clock into the model input and so into the
    # keys; they get one configured moment instead (a request may pass its own date as a kwarg).
    def strftime_now(fmt: str) -> str:
        return moment.strftime(str(fmt))

    return strftime_now


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
    rendering a prompt it is transparent (its body renders as is)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return str(caller())


def _environment(template_time: datetime) -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_at(template_time)
    return env


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
        root = Path(tokenizer_dir)
        try:
            tok_bytes = (root / "tokenizer.json").read_bytes()
            self._tokenizer = Tokenizer.from_str(tok_bytes.decode())
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
        self._env = _environment(template_time)
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._lock = threading.Lock()
        self._auto_formats: dict[str, str] = {}
        digest = hashlib.sha256(tok_bytes)
        for name in sorted(templates):
            digest.update(name.encode() + b"\0" + templates[name].encode() + b"\0")
        self.fingerprint = digest.hexdigest()[:16]

    def _template(self, source: str) -> jinja2.Template:
        with self._lock:
            compiled = self._compiled.get(source)
            if compiled is not None:
                self._compiled.move_to_end(source)
                return compiled
        try:
            compiled = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise NormalizerError(
                f"chat template does not compile: {exc.message}", param="chat_template"
            ) from None
        with self._lock:
            self._compiled[source] = compiled
            while len(self._compiled) > _TEMPLATE_CACHE_MAX:
                self._compiled.popitem(last=False)
        return compiled

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
                    if len(self._auto_formats) >= _TEMPLATE_CACHE_MAX:
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
                    msg["content"] = [
                        p if p.get("type") == "text" else {"type": str(p["type"]).split("_")[0]}
                        for p in content
                    ]
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
        try:
            text = self._template(source).render(**context)
        except jinja2.TemplateError as exc:
            raise NormalizerError(
                f"chat template failed: {exc}", param="messages", code="template_error"
            ) from None
        except Exception as exc:  # the template met request data of a type it cannot handle
            raise NormalizerError(
                f"chat template failed on the request: {type(exc).__name__}",
                param="messages",
                code="template_error",
            ) from None
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
