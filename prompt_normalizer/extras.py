"""Packages only tokenizer mode needs, and the message that names the extra installing them.

The base install canonicalizes in approximate and render modes; tokenizer mode renders the
model's chat template (jinja2) and tokenizes it locally (Hugging Face `tokenizers`), packages that
come with `pip install 'kvgate[tokenizer]'`. The config checks for them when it is loaded, so a
missing package stops start-up with this message instead of failing on the first request.
"""

from __future__ import annotations

import importlib.util

TOKENIZER_EXTRA = "kvgate[tokenizer]"
TOKENIZER_PACKAGES = ("tokenizers", "jinja2")


def tokenizer_mode_missing() -> str | None:
    """None when tokenizer mode can run here, else what is missing and how to install it.

    Looks the packages up without importing them (a config load stays cheap)."""
    missing = [name for name in TOKENIZER_PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return f"mode 'tokenizer' needs {' and '.join(missing)}: pip install '{TOKENIZER_EXTRA}'"
