"""Text in and out: the built-in and a folder's tokenizer round-trip text, the engine takes text prompts and stops
at end-of-sequence ids, the CLI generates from text, and bad input is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import v4compile
from v4compile.cli import main
from v4compile.runtime.engine import Engine
from v4compile.runtime.text import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.builtin()


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_builtin_tokenizer_round_trips_any_text(text: str) -> None:
    tokenizer = Tokenizer.builtin()
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)


def test_a_saved_folder_loads_the_same_tokenizer_chat_template_and_eos(tmp_path: Path, tokenizer: Tokenizer) -> None:
    tokenizer.save(tmp_path)
    loaded = Tokenizer.from_folder(tmp_path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    assert loaded.encode("héllo <|eos|>") == tokenizer.encode("héllo <|eos|>")
    assert loaded.encode("<|eos|>") == loaded.eos_ids == [257]
    assert loaded.chat(messages) == tokenizer.chat(messages)
    assert tokenizer.decode(tokenizer.chat(messages)) == "be briefhéllo"  # specials are not text


def test_bad_folders_and_messages_are_named(tmp_path: Path, tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizers file"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(ValueError, match="message 0 must be"):
        tokenizer.chat([{"role": "user"}])
    tokenizer.save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ raise_exception(\'no system\') }}"}')
    with pytest.raises(ValueError, match="the chat template refused the messages: no system"):
        Tokenizer.from_folder(tmp_path).chat([{"role": "user", "content": "x"}])


def test_the_engine_takes_text_and_stops_at_the_end_of_sequence(tiny_model: v4compile.DeepSeekV4,
                                                               tokenizer: Tokenizer) -> None:
    prompts = ["Hello, V4!", "a longer prompt about compressed attention"]
    engine = Engine(tiny_model, max_batch=2, tokenizer=tokenizer)
    by_text = engine.generate(prompts, 8)
    by_ids = Engine(tiny_model, max_batch=2).generate([tokenizer.encode(p) for p in prompts], 8)
    assert [r.tokens for r in by_text] == [r.tokens for r in by_ids]
    assert [r.text for r in by_text] == [tokenizer.decode(r.tokens) for r in by_ids]
    assert all(r.text is None for r in by_ids)
    # a stop id ends the request at its first occurrence, kept as the last token
    stop = by_text[0].tokens[3]
    (stopped,) = engine.generate(prompts[:1], 8, stop_ids=[stop])
    first = by_text[0].tokens.index(stop)
    assert stopped.tokens == by_text[0].tokens[: first + 1] and stopped.finish_reason == "stop"
    assert len(stopped.logprobs) == len(stopped.tokens)
    # MTP emits two tokens a step: a stop in the first ends the request before the second
    (speculated,) = engine.generate(prompts[:1], 8, stop_ids=[stop], mtp=True)
    assert speculated.tokens == stopped.tokens and speculated.finish_reason == "stop"
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        Engine(tiny_model).generate(["hi"], 2)


def test_cli_generates_from_text(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--text", "Hello, V4!", "--max-new-tokens", "5", "--json"]) == 0
    (out,) = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 5 and out["text"] == Tokenizer.builtin().decode(out["tokens"])
    assert main(["generate", "--text", "hi", "--ids", "1 2"]) == 2
    assert "not both" in capsys.readouterr().out
