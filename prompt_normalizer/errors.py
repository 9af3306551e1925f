"""The one error the normalizer raises for input it cannot turn into a model input."""

from __future__ import annotations


class NormalizerError(ValueError):
    """A request (or a configuration) the normalizer cannot canonicalize.

    `param` names the offending request field (`messages[3].content`), `code` is a short machine
    name. The gateway maps it to an OpenAI `invalid_request_error` with status 400. Messages never
    quote prompt content.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_prompt") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
