"""The OpenAI wire format for ``v4compile serve``: request bodies checked field by field into engine requests, and
the response objects and stream chunks of the completions and chat completions endpoints.

Every malformed body is a ``BadRequest`` naming the field (the server answers 400 with it): an unknown field, a
wrong type, a value out of range, a prompt the model cannot hold. Standard fields the engine does not implement are
accepted only at their no-op values (``n`` 1, ``echo`` false, penalties 0, no ``logprobs``), so a client never gets
silently different behaviour from what it asked for.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .text import Tokenizer

MAX_STOP_STRINGS = 4
DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions; chat requests default to what the context still holds."""

_SHARED = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
           "presence_penalty", "frequency_penalty", "logprobs"}
_FIELDS = {"completions": _SHARED | {"prompt", "echo"},
           "chat": _SHARED | {"messages", "max_completion_tokens", "top_logprobs"}}
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {"n": (1,), "echo": (False,), "presence_penalty": (0, 0.0),
                                             "frequency_penalty": (0, 0.0), "logprobs": (None, False),
                                             "top_logprobs": (None, 0)}


class BadRequest(ValueError):
    """A request body the server refuses; ``param`` names the offending field (None for the body itself)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        """The OpenAI error object for this refusal."""
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass
class Params:
    """One request as the engine takes it, plus what the server does around it (stop strings, streaming)."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise BadRequest(f"{name} must be in [{low}, {high}], got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"{name} must be an integer, got {value!r}", name)
    return value


def _check_fields(body: object, endpoint: str, model: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _FIELDS[endpoint])
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r} (this endpoint takes {', '.join(sorted(_FIELDS[endpoint]))})",
                         unknown[0])
    for name, allowed in _NO_OP_VALUES.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"{name}={body[name]!r} is not supported (only {allowed[0]!r})", name)
    if not isinstance(body.get("model"), str):
        raise BadRequest("model is required: a string naming the served model", "model")
    if body["model"] != model:
        raise BadRequest(f"model {body['model']!r} is not served here (this server serves {model!r})", "model",
                         status=404)
    return body


def _params(body: dict[str, Any], prompt: list[int], max_len: int, max_tokens: int | None, default_tokens: int,
            token_field: str) -> Params:
    if len(prompt) >= max_len:
        raise BadRequest(f"the prompt has {len(prompt)} tokens; the model holds at most {max_len} tokens including "
                         "at least one generated", "messages" if token_field == "max_completion_tokens" else "prompt")
    if max_tokens is None:
        max_tokens = min(default_tokens, max_len - len(prompt))
    elif max_tokens < 1:
        raise BadRequest(f"{token_field} must be at least 1, got {max_tokens}", token_field)
    elif len(prompt) + max_tokens > max_len:
        raise BadRequest(f"the prompt's {len(prompt)} tokens plus {token_field}={max_tokens} exceed the model's "
                         f"maximum length {max_len}", token_field)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, got "
                         f"{body.get('stop')!r}", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest(f"stream_options takes only include_usage, got {options!r}", "stream_options")
    return Params(prompt, max_tokens, _number(body, "temperature", 0.0, 2.0, 1.0),
                  _number(body, "top_p", 1e-9, 1.0, 1.0), _integer(body, "seed"), stop, stream,
                  bool(options.get("include_usage", False)))


def completion_request(body: object, tokenizer: Tokenizer, model: str, max_len: int) -> Params:
    """The engine request of a ``/v1/completions`` body: ``prompt`` is text or a list of token ids."""
    body = _check_fields(body, "completions", model)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} in prompt is outside the vocabulary [0, {tokenizer.vocab_size})",
                             "prompt")
        ids = prompt
    else:
        raise BadRequest("prompt must be a string or a non-empty list of token ids (one prompt per request)",
                         "prompt")
    if not ids:
        raise BadRequest("prompt is empty", "prompt")
    return _params(body, ids, max_len, _integer(body, "max_tokens"), DEFAULT_COMPLETION_TOKENS, "max_tokens")


def chat_request(body: object, tokenizer: Tokenizer, model: str, max_len: int) -> Params:
    """The engine request of a ``/v1/chat/completions`` body: ``messages`` rendered by the chat template."""
    body = _check_fields(body, "chat", model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str) \
                or set(m) - {"role", "content", "name"}:
            raise BadRequest(f"messages[{n}] must be {{'role': str, 'content': str}}, got {m!r}", "messages")
    try:
        ids = tokenizer.chat([{"role": m["role"], "content": m["content"]} for m in messages])
    except ValueError as exc:
        raise BadRequest(str(exc), "messages") from None
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    token_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise BadRequest(f"{token_field} must be an integer, got {limit!r}", token_field)
    return _params(body, ids, max_len, limit, max_len, token_field)


def truncate_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` cut before the first stop string it contains, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def held_back(text: str, stop: list[str]) -> int:
    """How many trailing characters of ``text`` could begin a stop string (not sent until the next tokens tell)."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class Response:
    """Builds one request's response objects: the whole reply or its stream chunks, for either endpoint."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        """The token counts of a request."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def whole(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        """The non-streamed reply."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._base(False), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        """One stream chunk: a text delta, or the last chunk with its finish reason."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**self._base(True), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The stream's closing usage chunk (``stream_options.include_usage``)."""
        return {**self._base(True), "choices": [], "usage": usage}
