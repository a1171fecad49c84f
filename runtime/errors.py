"""Typed errors the runtime raises. They carry facts (counts, limits), not HTTP statuses or CLI flag
names: the server maps them to statuses and wording, the CLI to flags."""
from __future__ import annotations


class EngineError(RuntimeError):
    """Base of the errors a request can meet in the engine."""


class InvalidRequest(EngineError):
    """The request itself cannot be served (empty prompt, a token id outside the vocabulary)."""


class BadConstraint(InvalidRequest):
    """A constrained-decoding spec (GenRequest.constraint) that cannot be compiled."""


class ImagesUnsupported(InvalidRequest):
    """Images in a request this engine cannot take them with (speculative decoding has no M-RoPE yet)."""


class ContextTooLong(EngineError):
    """The prompt (plus at least one generated token) does not fit the context or the KV pool.
    max_prompt_tokens: the most prompt tokens that would have been accepted."""

    def __init__(self, prompt_tokens: int, max_prompt_tokens: int, what: str = "context"):
        self.prompt_tokens, self.max_prompt_tokens, self.what = int(prompt_tokens), int(max_prompt_tokens), what
        super().__init__(f"prompt has {prompt_tokens} tokens; at most {max_prompt_tokens} fit the {what}")


class QueueFull(EngineError):
    def __init__(self, waiting: int):
        self.waiting = waiting
        super().__init__(f"{waiting} requests are already waiting")


class QueueTimeout(EngineError):
    def __init__(self, waited_s: float):
        self.waited_s = waited_s
        super().__init__(f"request waited {waited_s:.1f}s in the queue")


class EngineStopped(EngineError):
    def __init__(self, msg: str = "engine is not running"):
        super().__init__(msg)


class ConfigError(ValueError):
    """A bad engine setting; `field` names the EngineConfig field (the CLI turns it into its flag)."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")
