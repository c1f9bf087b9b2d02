"""``v4compile serve``: an OpenAI-compatible HTTP server over the engine's continuous batching.

One thread owns the engine (``EngineLoop``): it takes new requests between steps, runs ``Engine.step`` while any
request is live and hands each request its new tokens through a queue. Each HTTP connection runs in its own
thread (``ThreadingHTTPServer``), turns tokens into text (stop strings are cut there, and a stop string ends the
engine request) and writes the reply, or its server-sent-event chunks as they come. A client that goes away
mid-stream cancels its request, which frees its rows at the next step; the other requests go on. Endpoints:
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .. import logs
from .engine import Engine
from .openai_api import BadRequest, Params, Response, chat_request, completion_request, held_back, truncate_at_stop
from .requests import RequestOutput

_LOG = logs.logger("engine")
MAX_BODY_BYTES = 8 << 20


@dataclass
class Ticket:
    """One request's link between its connection thread and the engine thread: ``events`` receives
    ("tokens", [ids]) as steps produce them, then ("done", finish reason) or ("error", message)."""

    params: Params
    events: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)
    output: RequestOutput | None = None
    sent: int = 0
    cancelled: bool = False


class EngineLoop:
    """Runs ``engine`` in a thread of its own: the only code that calls into it while the server runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.incoming: queue.Queue[Ticket] = queue.Queue()
        self.live: list[Ticket] = []
        self.finished: Counter[str] = Counter()
        """Requests finished so far, by engine finish reason ("abort": cancelled by a client that went away)."""
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="v4compile-engine", daemon=True)
        self.thread.start()

    def submit(self, params: Params) -> Ticket:
        """Queues a request; its events arrive on the returned ticket."""
        ticket = Ticket(params)
        self.incoming.put(ticket)
        return ticket

    def stop(self) -> None:
        """Ends the loop after the current step."""
        self.stopping.set()
        self.thread.join(timeout=30)

    @property
    def active(self) -> int:
        """Requests submitted and not finished (read from any thread; a snapshot)."""
        return len(self.live) + self.incoming.qsize()

    def _run(self) -> None:
        while not self.stopping.is_set():
            self._admit(block=not self.engine.busy)
            for ticket in self.live:
                if ticket.cancelled and ticket.output is not None:
                    self.engine.cancel(ticket.output)
            if self.engine.busy:
                try:
                    self.engine.step()
                except Exception as exc:  # a failed step fails the requests it ran, not the server
                    _LOG.exception("engine step failed")
                    self._fail_all(f"the engine failed: {type(exc).__name__}: {exc}")
                    continue
            self._deliver()

    def _admit(self, block: bool) -> None:
        try:
            ticket = self.incoming.get(timeout=0.05) if block else self.incoming.get_nowait()
        except queue.Empty:
            return
        while True:
            p = ticket.params
            ticket.output = self.engine.submit(p.prompt, p.max_tokens, p.temperature, p.top_p, p.seed)
            if ticket.output.error:
                ticket.events.put(("error", ticket.output.error))
            else:
                self.live.append(ticket)
            try:
                ticket = self.incoming.get_nowait()
            except queue.Empty:
                return

    def _deliver(self) -> None:
        for ticket in list(self.live):
            out = ticket.output
            assert out is not None
            if len(out.tokens) > ticket.sent:
                ticket.events.put(("tokens", out.tokens[ticket.sent :]))
                ticket.sent = len(out.tokens)
            if out.finish_reason:
                ticket.events.put(("done", out.finish_reason))
                self.finished[out.finish_reason] += 1
                self.live.remove(ticket)

    def _fail_all(self, message: str) -> None:
        for ticket in self.live:
            assert ticket.output is not None
            self.engine.cancel(ticket.output)
            ticket.events.put(("error", message))
        self.live.clear()
        try:
            self.engine.step()
        except Exception:
            _LOG.exception("dropping the failed requests failed too")


class _Disconnected(Exception):
    """The client closed its connection."""


class _Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        _LOG.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:  # noqa: N802 (the base class's name)
        if self.path == "/health":
            self._json(200, {"status": "ok", "active_requests": self.server.loop.active,
                             "finished_requests": dict(self.server.loop.finished)})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                         "created": 0, "owned_by": "v4compile"}]})
        else:
            self._json(404, BadRequest(f"no such endpoint: GET {self.path}", status=404).body())

    def do_POST(self) -> None:  # noqa: N802 (the base class's name)
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self._json(404, BadRequest(f"no such endpoint: POST {self.path}", status=404).body())
            return
        try:
            params = self._params(chat)
        except BadRequest as exc:
            self._json(exc.status, exc.body())
            return
        ticket = self.server.loop.submit(params)
        try:
            if params.stream:
                self._stream(ticket, Response(chat, self.server.model_name))
            else:
                self._whole(ticket, Response(chat, self.server.model_name))
        except _Disconnected:
            ticket.cancelled = True
            _LOG.info("client went away: request cancelled")

    def _params(self, chat: bool) -> Params:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise BadRequest("a request body with a Content-Length header is required") from None
        if not 0 < length <= MAX_BODY_BYTES:
            raise BadRequest(f"the request body must be 1 to {MAX_BODY_BYTES} bytes, got {length}")
        try:
            body = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None
        parse = chat_request if chat else completion_request
        return parse(body, self.server.tokenizer, self.server.model_name, self.server.max_len)

    def _events(self, ticket: Ticket) -> Iterator[tuple[str, str]]:
        """("text", delta) for the ticket's tokens, stop strings cut (and held back while they could begin one),
        then ("done", finish reason) or ("error", message)."""
        tokens: list[int] = []
        shown = ""
        stop = ticket.params.stop
        while True:
            kind, value = ticket.events.get()
            if self._client_gone():
                raise _Disconnected
            if kind != "tokens":
                if kind == "done":
                    text = self.server.tokenizer.decode(tokens)
                    if text[len(shown):]:
                        yield "text", text[len(shown):]
                yield kind, value
                return
            tokens += value
            text, stopped = truncate_at_stop(self.server.tokenizer.decode(tokens), stop)
            end = len(text) if stopped else len(text) - held_back(text, stop)
            if end > len(shown):
                yield "text", text[len(shown):end]
                shown = text[:end]
            if stopped:
                ticket.cancelled = True
                yield "done", "stop"
                return

    def _client_gone(self) -> bool:
        """Whether the client closed its end (seen without writing: tokens that add no text write nothing)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _whole(self, ticket: Ticket, response: Response) -> None:
        parts: list[str] = []
        for kind, value in self._events(ticket):
            if kind == "text":
                parts.append(value)
            elif kind == "error":
                self._json(400, BadRequest(value, "prompt").body())
                return
            else:
                assert ticket.output is not None
                finish = "stop" if value in ("stop", "abort") else value
                usage = Response.usage(len(ticket.params.prompt), len(ticket.output.tokens))
                self._json(200, response.whole("".join(parts), finish, usage))

    def _stream(self, ticket: Ticket, response: Response) -> None:
        started = False
        for kind, value in self._events(ticket):
            if kind == "error" and not started:
                self._json(400, BadRequest(value, "prompt").body())
                return
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self._send_event(response.chunk(None, first=True))
                started = True
            if kind == "text":
                self._send_event(response.chunk(value))
            elif kind == "error":
                self._send_event({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
            else:
                self._send_event(response.chunk(None, "stop" if value in ("stop", "abort") else value))
                if ticket.params.include_usage:
                    assert ticket.output is not None
                    self._send_event(response.usage_chunk(Response.usage(len(ticket.params.prompt),
                                                                         len(ticket.output.tokens))))
        self._write(b"data: [DONE]\n\n")
        self.close_connection = True

    def _send_event(self, payload: dict[str, Any]) -> None:
        self._write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _Disconnected from exc

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _Disconnected from exc
        self._write(data)


class Server(ThreadingHTTPServer):
    """The HTTP server: ``serve_forever`` in the calling thread (``start`` for a background thread); ``close``
    stops it and the engine loop."""

    daemon_threads = True

    def __init__(self, engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000) -> None:
        if engine.tokenizer is None:
            raise ValueError("the server needs an engine with a tokenizer (Engine(model, tokenizer=...))")
        super().__init__((host, port), _Handler)
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_len = engine.max_seq_len
        self.loop = EngineLoop(engine)

    @property
    def url(self) -> str:
        """The base URL clients use (``.../v1``)."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> threading.Thread:
        """Serves in a daemon thread (tests, notebooks)."""
        thread = threading.Thread(target=self.serve_forever, name="v4compile-http", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stops serving and the engine loop."""
        self.shutdown()
        self.server_close()
        self.loop.stop()
