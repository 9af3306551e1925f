"""The sandboxed Jinja environment chat templates render in (tokenizer mode only).

The environment matches what Hugging Face `apply_chat_template` (and so vLLM) gives a template:
`trim_blocks`, `lstrip_blocks`, the loop-controls extension, a `tojson` filter that keeps key
order and non-ASCII text, `raise_exception`, and `strftime_now` at a fixed configured moment,
never the wall clock. Jinja's errors become `NormalizerError`s here, so no other module needs
jinja2; `prompt_normalizer.template` imports this module only when a tokenizer-mode normalizer is
built, which keeps jinja2 out of an approximate-mode process.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from prompt_normalizer.errors import NormalizerError

_TEMPLATE_CACHE_MAX = 16


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


class TemplateRenderer:
    """Renders chat-template sources, each compiled once (a bounded, thread-safe LRU: a request
    may bring its own template, so the cache cannot grow with the traffic)."""

    def __init__(self, template_time: datetime) -> None:
        self._env = _environment(template_time)
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._lock = threading.Lock()

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

    def render(self, source: str, context: dict[str, Any]) -> str:
        """The template's text for `context`; any failure is a `NormalizerError`."""
        template = self._template(source)
        try:
            return template.render(**context)
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
