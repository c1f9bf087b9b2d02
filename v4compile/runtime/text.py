"""Text in and out: a checkpoint folder's tokenizer (``tokenizer.json`` through the ``tokenizers`` library, its chat
template and end-of-sequence tokens from ``tokenizer_config.json``), or a built-in byte-level one for models that
ship none (the presets with random weights), so prompts and outputs can be text in the engine and the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

BUILTIN_SPECIALS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>")
BUILTIN_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_alphabet() -> list[str]:
    """The printable character byte-level BPE uses for each byte value (GPT-2's table), indexed by the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class Tokenizer:
    """Text <-> token ids for one model: ``encode``, ``decode``, ``chat`` (the chat template applied to messages)
    and ``eos_ids`` (the ids that end a generation)."""

    def __init__(self, tokenizer: HFTokenizer, eos: list[str], chat_template: str | None, source: str,
                 bos: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.chat_template = chat_template
        self.eos_ids = [i for i in (tokenizer.token_to_id(t) for t in eos) if i is not None]
        self.template_tokens = {"bos_token": bos or "", "eos_token": eos[0] if eos else ""}

    @classmethod
    def builtin(cls) -> Tokenizer:
        """A byte-level tokenizer (id = byte value, then the specials ``BUILTIN_SPECIALS``) for a model whose folder
        brings none; it needs a vocabulary of at least 261 ids (the tiny preset has 512)."""
        vocab = {ch: b for b, ch in enumerate(_byte_alphabet())}
        tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(list(BUILTIN_SPECIALS))
        return cls(tokenizer, ["<|eos|>"], BUILTIN_CHAT_TEMPLATE, "built-in byte-level", bos="<|bos|>")

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """The tokenizer a checkpoint folder ships: ``tokenizer.json``, with the chat template and the ``eos_token``
        of ``tokenizer_config.json`` when present. A missing or unreadable file is a ValueError naming it."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer in {folder}: {path.name} is missing (token-id prompts still work)")
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception type for unreadable files
            raise ValueError(f"{path} is not a tokenizers file: {exc}") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
        eos, bos = (_token(config.get(key)) for key in ("eos_token", "bos_token"))
        return cls(tokenizer, [eos] if eos else [], config.get("chat_template"), str(path), bos=bos)

    def save(self, folder: str | Path) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (chat template, eos token) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(folder / "tokenizer.json"))
        eos = [self.tokenizer.id_to_token(i) for i in self.eos_ids]
        config = {"chat_template": self.chat_template, "eos_token": eos[0] if eos else None,
                  "bos_token": self.template_tokens["bos_token"] or None}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can produce (specials included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (special tokens written in it are recognised)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` without special tokens (bytes that do not complete a character are dropped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of ``messages`` (``{"role": ..., "content": ...}``) rendered by the chat template, ending where
        the assistant's reply begins. A ValueError when the tokenizer has no template or a message is malformed."""
        if not self.chat_template:
            raise ValueError(f"the tokenizer ({self.source}) has no chat template; send plain text instead")
        for n, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {n} must be {{'role': str, 'content': str}}, got {m!r}")
        template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(self.chat_template)
        return self.encode(template.render(messages=messages, add_generation_prompt=True, **self.template_tokens,
                                           raise_exception=_template_error))


def _token(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _template_error(message: str) -> None:
    """``raise_exception`` for chat templates (they call it on messages they refuse)."""
    raise ValueError(f"the chat template refused the messages: {message}")
