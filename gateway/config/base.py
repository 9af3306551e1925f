"""What every block of the config shares: frozen models that reject unknown fields, positive
numbers, and the one error a bad config raises."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the problem."""


class Frozen(BaseModel):
    """A config block: immutable once parsed, and an unknown field is an error."""

    # `.inf` and `.nan` are YAML floats: no setting means either (an infinite weight or time
    # would turn scores and deadlines into NaN or overflow far from the line that set it).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def read_file_or_env(field: str, file: str | None, env: str | None, environ: Mapping[str, str]) -> str | None:
    """A secret named by `<field>_file` or `<field>_env` (None when neither is set): the file's text
    without trailing whitespace, or the variable's value. Empty is an error; errors name the
    field and the source, never the value."""
    if file is not None:
        try:
            value = Path(file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
            raise ConfigError(f"{field}_file: cannot read {file!r}: {reason}") from None
        if not value:
            raise ConfigError(f"{field}_file: {file!r} is empty")
        return value
    if env is not None:
        value = environ.get(env, "")
        if not value:
            raise ConfigError(f"{field}_env: environment variable {env} is not set")
        return value
    return None
