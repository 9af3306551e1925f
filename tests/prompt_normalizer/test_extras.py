"""Tokenizer mode names the `kvgate[tokenizer]` extra when its packages are missing; the other
modes never need them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from prompt_normalizer.config import NormalizerConfig
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.extras import TOKENIZER_PACKAGES, tokenizer_mode_missing
from prompt_normalizer.template import ChatTemplateTokenizer


def _uninstall(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    # A None entry in sys.modules makes both find_spec and import behave as if it were absent.
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_nothing_is_missing_where_the_extra_is_installed() -> None:
    assert tokenizer_mode_missing() is None


@pytest.mark.parametrize("names", [("tokenizers",), ("jinja2",), TOKENIZER_PACKAGES])
def test_a_tokenizer_mode_config_names_the_missing_packages_and_the_extra(
    monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]
) -> None:
    _uninstall(monkeypatch, *names)
    with pytest.raises(ValidationError) as err:
        NormalizerConfig(mode="tokenizer", tokenizer_dir="/models/m")
    assert f"mode 'tokenizer' needs {' and '.join(names)}: pip install 'kvgate[tokenizer]'" in str(err.value)


@pytest.mark.parametrize("mode", ["approximate", "render"])
def test_other_modes_load_without_the_packages(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    _uninstall(monkeypatch, *TOKENIZER_PACKAGES)
    assert NormalizerConfig.model_validate({"mode": mode}).mode == mode


def test_building_the_tokenizer_without_the_package_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    _uninstall(monkeypatch, "tokenizers")
    with pytest.raises(NormalizerError) as err:
        ChatTemplateTokenizer(str(tiny_model_dir))
    assert err.value.code == "bad_config"
    assert "kvgate[tokenizer]" in err.value.message
