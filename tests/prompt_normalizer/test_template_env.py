"""Template failures are NormalizerErrors naming the field at fault."""

from __future__ import annotations

from datetime import datetime

import pytest

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.template_env import TemplateRenderer

RENDERER = TemplateRenderer(datetime(2030, 12, 24))


def test_a_template_that_does_not_compile_names_the_template() -> None:
    with pytest.raises(NormalizerError) as err:
        RENDERER.render("{% for m in messages %}{{ m }}", {"messages": []})
    assert err.value.param == "chat_template"
    assert err.value.message.startswith("chat template does not compile")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ raise_exception('no system role') }}", "chat template failed: no system role"),
        ("{{ 'docs: ' + documents }}", "chat template failed on the request: TypeError"),
    ],
)
def test_a_failing_render_names_the_messages(source: str, message: str) -> None:
    with pytest.raises(NormalizerError) as err:
        RENDERER.render(source, {"documents": [1]})
    assert (err.value.param, err.value.code, err.value.message) == ("messages", "template_error", message)


def test_the_environment_keeps_key_order_and_the_configured_date() -> None:
    text = RENDERER.render("{{ {'b': 1, 'a': 'é'} | tojson }} {{ strftime_now('%d %b %Y') }}", {})
    assert text == '{"b": 1, "a": "é"} 24 Dec 2030'
