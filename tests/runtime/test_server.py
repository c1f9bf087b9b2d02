"""``v4compile serve`` end to end on 127.0.0.1 with the official ``openai`` client: completions and chat, streamed
and whole, equal to the engine's own output; seeds, stop strings, usage; bad input over the wire answered with a
400 naming the field while another request streams on; a client that goes away frees its rows."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import v4compile
from v4compile.cli import main
from v4compile.runtime.engine import Engine
from v4compile.runtime.server import Server
from v4compile.runtime.text import Tokenizer

NAME = "v4compile-tiny"


def _call(url: str, body: Any = None) -> tuple[int, Any]:
    """(status, decoded JSON) of a GET (no body) or a POST of ``body`` (bytes as they are, else JSON)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server(tiny_model: v4compile.DeepSeekV4) -> Iterator[Server]:
    srv = Server(Engine(tiny_model, max_batch=4, tokenizer=Tokenizer.builtin()), NAME, port=0)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_model: v4compile.DeepSeekV4) -> Engine:
    """A second engine on the same model: what the server must answer, computed without HTTP."""
    return Engine(tiny_model, max_batch=4, tokenizer=Tokenizer.builtin())


def test_completions_are_the_engines_output(client: openai.OpenAI, reference: Engine) -> None:
    got = client.completions.create(model=NAME, prompt="Hello, V4!", max_tokens=12, temperature=0)
    want = reference.generate(["Hello, V4!"], 12)[0]
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == ("stop" if want.finish_reason == "stop" else "length")
    assert got.usage.prompt_tokens == len("Hello, V4!") and got.usage.completion_tokens == len(want.tokens)
    ids = client.completions.create(model=NAME, prompt=[72, 105, 33], max_tokens=5, temperature=0)
    assert ids.choices[0].text == reference.generate([[72, 105, 33]], 5)[0].text


def test_a_streamed_chat_reply_is_the_whole_reply(client: openai.OpenAI, reference: Engine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is C4 attention?"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = reference.tokenizer.chat(messages)
    assert whole.choices[0].message.content == streamed == reference.generate([prompt], 20)[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(prompt)


def test_a_seed_repeats_a_sampled_reply(client: openai.OpenAI) -> None:
    ask = dict(model=NAME, prompt="sample me", max_tokens=16, temperature=1.0, top_p=0.9)
    first = client.completions.create(seed=7, **ask).choices[0].text
    assert client.completions.create(seed=7, **ask).choices[0].text == first
    assert any(client.completions.create(seed=s, **ask).choices[0].text != first for s in (8, 9, 10))


def test_stop_strings_cut_the_reply_streamed_or_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model=NAME, prompt="stop test", max_tokens=40, temperature=0).choices[0].text
    assert len(full) >= 6, full
    stop = full[3:5]
    want = full[: full.find(stop)]
    got = client.completions.create(model=NAME, prompt="stop test", max_tokens=40, temperature=0, stop=[stop, "\x00"])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "stop")
    chunks = list(client.completions.create(model=NAME, prompt="stop test", max_tokens=40, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_requests_are_400s_naming_the_field_while_a_stream_goes_on(server: Server,
                                                                       client: openai.OpenAI) -> None:
    streamed: list[str] = []
    finish: list[str | None] = []

    def stream() -> None:
        for chunk in client.completions.create(model=NAME, prompt="keep going", max_tokens=120, temperature=0,
                                               stream=True):
            streamed.append(chunk.choices[0].text)
            finish.append(chunk.choices[0].finish_reason)

    runner = threading.Thread(target=stream)
    runner.start()
    url = server.url + "/completions"
    too_long = [65] * server.max_len
    cases = [
        (b"{not json", None, "not valid JSON"),
        ({"model": NAME, "prompt": "x", "foo": 1}, "foo", "unknown field 'foo'"),
        ({"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"model": NAME, "prompt": "x", "max_tokens": -4}, "max_tokens", "at least 1"),
        ({"model": NAME, "prompt": too_long}, "prompt", f"at most {server.max_len} tokens"),
        ({"model": NAME, "prompt": "x", "max_tokens": server.max_len}, "max_tokens", "exceed"),
        ({"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
        ({"model": NAME, "prompt": [70000]}, "prompt", "outside the vocabulary"),
        ({"model": NAME, "prompt": "x", "n": 3}, "n", "not supported"),
        ({"prompt": "x"}, "model", "model is required"),
        ({"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"model": NAME, "prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ]
    for body, param, needle in cases:
        status, reply = _call(url, body)
        assert status == 400, (body, reply)
        assert reply["error"]["param"] == param and needle in reply["error"]["message"], (body, reply)
    status, reply = _call(server.url + "/chat/completions", {"model": NAME, "messages": [{"role": "user"}]})
    assert status == 400 and reply["error"]["param"] == "messages"
    status, reply = _call(url, {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and "not served here" in reply["error"]["message"]
    assert _call(server.url + "/models")[1]["data"][0]["id"] == NAME
    runner.join(timeout=120)
    assert finish[-1] in ("length", "stop") and streamed, finish


def test_a_client_that_goes_away_frees_its_rows(tiny_model: v4compile.DeepSeekV4) -> None:
    """A stream of thousands of tokens (a tokenizer without an end-of-sequence id, so nothing stops it early)
    whose client leaves after three events: the engine drops it ("abort") and serves the next request."""
    tokenizer = Tokenizer.builtin()
    tokenizer.eos_ids = []
    server = Server(Engine(tiny_model, max_batch=2, tokenizer=tokenizer), NAME, port=0)
    server.start()
    try:
        host, port = server.server_address[:2]
        connection = http.client.HTTPConnection(host, port, timeout=60)
        connection.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "a long story",
                                                                   "max_tokens": 4000, "stream": True}))
        reply = connection.getresponse()
        events = 0
        while events < 3:
            events += reply.readline().startswith(b"data: ")
        reply.close()
        connection.close()
        deadline = time.monotonic() + 60
        while (server.loop.active or server.loop.engine.busy) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.loop.active and not server.loop.engine.busy
        assert server.loop.finished == {"abort": 1}, server.loop.finished
        assert _call(server.url.removesuffix("/v1") + "/health")[1]["active_requests"] == 0
        status, done = _call(server.url + "/completions", {"model": NAME, "prompt": "still here", "max_tokens": 3})
        assert status == 200 and done["usage"]["completion_tokens"] == 3
    finally:
        server.close()


def test_serve_bench_drives_the_server_with_concurrent_clients(server: Server,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-bench", "--server", server.url, "--clients", "3", "--requests", "5", "--max-tokens", "6",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 5 and report["failed"] == 0 and report["errors"] == []
    assert 5 <= report["completion_tokens"] <= 30 and report["tokens_per_s"] > 0
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p90_ms"]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_serve_command_serves_a_checkpoint_folder_with_its_tokenizer(tmp_path: Path, stop: int) -> None:
    """`v4compile serve --checkpoint DIR` as a user starts it: the folder's tokenizer and name, then Ctrl-C (SIGINT) or
    SIGTERM stops it, also when it inherited SIGINT ignored (a script's background job; this test's runner)."""
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0)
    v4compile.save(model, tmp_path / "tiny-ckpt")
    Tokenizer.builtin().save(tmp_path / "tiny-ckpt")
    process = subprocess.Popen([sys.executable, "-m", "v4compile.cli", "serve", "--checkpoint",
                                str(tmp_path / "tiny-ckpt"), "--port", "0"], stdout=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "COLUMNS": "200", "PYTHONFAULTHANDLER": "1"})
    try:
        line = ""
        while "serving" not in line:
            line = process.stdout.readline()
            assert line or process.poll() is None, "the server exited before serving"
        url = re.search(r"http://[\d.]+:\d+/v1", line).group(0)
        status, reply = _call(url + "/completions", {"model": "tiny-ckpt", "prompt": "hi", "max_tokens": 4})
        assert status == 200 and reply["usage"]["prompt_tokens"] == 2, reply
    finally:
        process.send_signal(stop)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            rest = process.communicate(timeout=30)[0]
            pytest.fail(f"the server had not stopped 60 s after {signal.Signals(stop).name}; its last output:\n"
                        f"{rest[-6000:]}")
        assert code == 0
