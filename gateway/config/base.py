"""What every block of the config shares: frozen models that reject unknown fields, positive
numbers, and the one error a bad config raises."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the problem."""


class Frozen(BaseModel):
    """A config block: immutable once parsed, and an unknown field is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)
