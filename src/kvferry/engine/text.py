"""Tokenizers behind one interface: the tiny model's bytes, or a real BPE (`tokenizers`) with a chat template.

`TextCodec` is what the engine and the API need: ids ↔ text, the EOS id, an incremental detokenizer,
and `apply_chat_template` (jinja2, rendered the way transformers renders it: trim_blocks, lstrip_blocks)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Protocol

from kvferry.engine import tokenizer as byte_tokenizer

# ChatML, for the tiny model (its answers are bytes from random weights, but the protocol works the same).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Detokenizer(Protocol):
    def push_many(self, token_ids: Iterable[int]) -> str: ...
    def finish(self) -> str: ...


class TextCodec(Protocol):
    name: str
    vocab_size: int
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: Iterable[int]) -> str: ...
    def detokenizer(self) -> Detokenizer: ...
    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str: ...


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template (the client's fault: HTTP 400)."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        import jinja2
        import jinja2.sandbox

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self._template = env.from_string(source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        import jinja2

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True, **self._tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc


class ByteCodec:
    """The tiny model's byte-level tokenizer (ids 0..255 are UTF-8 bytes, 256 is EOS)."""

    name = "bytes"
    vocab_size = byte_tokenizer.VOCAB_SIZE
    eos_token_id = byte_tokenizer.EOS_TOKEN_ID

    def __init__(self) -> None:
        self._chat = ChatTemplate(TINY_CHAT_TEMPLATE, "", "<|im_end|>")

    def encode(self, text: str) -> list[int]:
        return byte_tokenizer.encode(text)

    def decode(self, token_ids: Iterable[int]) -> str:
        return byte_tokenizer.decode(token_ids)

    def detokenizer(self) -> Detokenizer:
        return byte_tokenizer.IncrementalDetokenizer()

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        return self._chat.render(messages)


class BPECodec:
    """A `tokenizers.Tokenizer` (tokenizer.json) with its chat template."""

    def __init__(self, tokenizer_json: str, chat_template: str, eos_token_id: int, bos_token: str = "") -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        self.name = "bpe"
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = eos_token_id
        eos_token = self._tokenizer.id_to_token(eos_token_id) or ""
        self._chat = ChatTemplate(chat_template, bos_token, eos_token)

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (e.g. "<|im_start|>" from a chat template) are recognized.
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Iterable[int]) -> str:
        ids = list(token_ids)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def detokenizer(self) -> Detokenizer:
        return _BPEDetokenizer(self)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        return self._chat.render(messages)


class _BPEDetokenizer:
    """Streams text by decoding all ids so far and emitting the new suffix; a trailing U+FFFD (a byte
    sequence not yet complete) is held back until more ids arrive or the stream ends."""

    def __init__(self, codec: BPECodec) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._sent = 0

    def push_many(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(token_ids)
        text = self._codec.decode(self._ids)
        end = len(text.rstrip("\ufffd"))
        if end <= self._sent:
            return ""
        delta = text[self._sent : end]
        self._sent = end
        return delta

    def finish(self) -> str:
        text = self._codec.decode(self._ids)
        delta = text[self._sent :]
        self._sent = len(text)
        return delta
