"""`NormalizerConfig`: the per-pool normalizer section of the policy YAML.

Self-contained (pydantic v2, `extra="forbid"`, frozen) so the policy schema can embed it as is, e.g.

```yaml
normalizer:
  mode: tokenizer
  tokenizer_dir: /models/qwen2.5-7b-instruct
  canonical_json: true
  tool_order: preserve
  volatile_rules:
    - {name: clock, pattern: 'Current time: [^\n]*', roles: [system], action: move_to_end}
    - {name: reasoning, field: reasoning_content, roles: [assistant], action: drop}
```

docs/normalizer.md is the reference for every field.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prompt_normalizer.extras import tokenizer_mode_missing
from prompt_normalizer.linear_regex import LinearPattern

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ALL_ROLES: tuple[Role, ...] = ("system", "developer", "user", "assistant", "tool", "function")
TEMPLATE_TIME_DEFAULT = datetime(2025, 1, 1)


class VolatileRule(BaseModel):
    """One thing the policy declares volatile, and what to do with it.

    Exactly one of `field` (a message field such as `reasoning_content`) or `pattern` (a regular
    expression in RE2 syntax, matched in the text content of messages in linear time) is set.
    `roles` limits the messages it applies to; `scope="before_last_user"` limits it to messages
    before the last user message (earlier turns). Actions: `move_to_end` takes the matched text
    out of its place and puts it in one trailing message (the volatile zone), `drop` removes it
    from the model input, and `keep_and_warn` leaves it in place and adds a diagnostic.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=64)
    field: str | None = None
    pattern: str | None = None
    roles: tuple[Role, ...] = ALL_ROLES
    scope: Literal["all", "before_last_user"] = "all"
    action: Literal["move_to_end", "drop", "keep_and_warn"] = "move_to_end"

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        # RE2 runs it, in time linear in the text (prompt_normalizer/linear_regex.py).
        if value is not None and LinearPattern(value).matches_empty():
            raise ValueError("pattern matches the empty string")
        return value

    @field_validator("field")
    @classmethod
    def _not_role(cls, value: str | None) -> str | None:
        if value is not None and value in ("role", ""):
            raise ValueError("field must be a message field other than 'role'")
        return value

    @model_validator(mode="after")
    def _one_matcher(self) -> VolatileRule:
        if (self.field is None) == (self.pattern is None):
            raise ValueError("set exactly one of 'field' or 'pattern'")
        return self


class ZoneConfig(BaseModel):
    """Which leading messages form the immutable zone.

    The immutable zone is the longest leading run of messages that are either of a role in
    `immutable_roles`, or few-shot turns: messages whose `name` is in `few_shot_names`, or among the
    first `few_shot_messages` messages that are not of an immutable role. The first other message is
    the first real turn; everything from there on is append-only (volatile content goes last).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    immutable_roles: tuple[Role, ...] = ("system", "developer")
    tools_immutable: bool = True
    few_shot_names: tuple[str, ...] = ("example_user", "example_assistant")
    few_shot_messages: int = Field(0, ge=0, le=1000)


class NormalizerConfig(BaseModel):
    """Per-pool normalizer settings (part of the policy YAML); every field has a safe default."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mode: Literal["approximate", "tokenizer", "render"] = "approximate"
    # approximate mode: one "token" per `chars_per_token` characters of canonical text.
    chars_per_token: int = Field(4, ge=1, le=64)
    # tokenizer mode: a directory with tokenizer.json and tokenizer_config.json (chat_template).
    tokenizer_dir: str | None = None
    chat_template_file: str | None = None
    content_format: Literal["auto", "string", "openai"] = "auto"
    completions_add_special_tokens: bool = True
    # What a template's `strftime_now(...)` prints. Fixed, so keys never depend on the wall clock;
    # a request can still carry its own date through `chat_template_kwargs` (e.g. `date_string`).
    template_time: datetime = TEMPLATE_TIME_DEFAULT

    canonical_json: bool = True
    tool_order: Literal["preserve", "sort"] = "preserve"
    property_order: Literal["preserve", "sort"] = "preserve"
    whitespace: bool = False
    unicode_nfc: bool = True

    zones: ZoneConfig = Field(default_factory=ZoneConfig)
    volatile_rules: tuple[VolatileRule, ...] = ()
    volatile_role: Literal["system", "developer", "user"] = "system"

    session_fields: tuple[Literal["prompt_cache_key", "user", "safety_identifier"], ...] = (
        "prompt_cache_key",
        "user",
    )
    drift_sessions_max: int = Field(10_000, ge=0, le=10_000_000)
    drift_store_max_blocks: int = Field(2_000_000, ge=0, le=1_000_000_000)
    max_input_chars: int = Field(8_000_000, ge=1)

    @model_validator(mode="after")
    def _mode_needs(self) -> NormalizerConfig:
        if self.mode == "tokenizer" and not self.tokenizer_dir:
            raise ValueError("mode 'tokenizer' needs 'tokenizer_dir'")
        if self.mode == "tokenizer" and (missing := tokenizer_mode_missing()):
            raise ValueError(missing)
        names = [rule.name for rule in self.volatile_rules]
        if len(names) != len(set(names)):
            raise ValueError("volatile_rules names must be unique")
        return self
