"""What a caller asks of the engine and what it gets back, one object per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.routing import Routing


class RequestError(ValueError):
    """A request the engine cannot serve (the message names what is wrong); other requests go on."""


@dataclass
class CacheStats:
    """Prefix-cache outcome of one request, in tokens."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens restored from the prefix cache instead of computed."""
    recomputed_tokens: int = 0
    """Tokens whose compressed entries were cached but computed again because the window tail at the
    deeper boundary had been evicted (the price of a tombstone)."""
    prefill_tokens: int = 0
    """Prompt tokens the engine computed."""


@dataclass
class RequestOutput:
    """Generated token ids and their log-probabilities (under the model's untempered distribution), the
    reason generation stopped ("length", "stop": a stop id was generated, "error"), prefix-cache statistics, MTP
    draft counts, the recorded routing, the text, or the error that rejected the request."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    cache: CacheStats = field(default_factory=CacheStats)
    error: str | None = None
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    routing: Routing | None = None
    """With ``record_routing``: every layer's experts and indexer entries for the fed tokens (prompt and
    output but its last token), ready for ``model(ids, routing=output.routing.for_replay())``."""
    text: str | None = None
    """The generated tokens as text, when the engine has a tokenizer."""
