"""The error a request that cannot be served raises: a leaf, so that everything that checks a request (its sampling
parameters, its grammar, the engine's intake) can raise it without importing the others."""
from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot be served as asked (too long, bad parameters); other requests are unaffected.
    `param` names the sampling parameter or input at fault ("prompt", "max_tokens", ...), `code` a machine-readable
    reason (e.g. "context_length_exceeded"); the server maps both onto its own field names."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
