"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, 256 is end-of-sequence."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

EOS_TOKEN_ID = 256
VOCAB_SIZE = 257


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(token_ids: Iterable[int]) -> str:
    """UTF-8 text of the byte tokens; EOS is skipped, invalid byte runs become U+FFFD."""
    return _to_bytes(token_ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Streams text as tokens arrive, holding back a multi-byte character until it is complete: every
    `push` result plus `finish()` equals `decode(all ids)`."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self.push_many((token_id,))

    def push_many(self, token_ids: Iterable[int]) -> str:
        return self._decoder.decode(_to_bytes(token_ids))

    def finish(self) -> str:
        """Flush a dangling partial character (as U+FFFD) at the end of the stream."""
        return self._decoder.decode(b"", final=True)


def _to_bytes(token_ids: Iterable[int]) -> bytes:
    out = bytearray()
    for token_id in token_ids:
        if token_id == EOS_TOKEN_ID:
            continue
        if not 0 <= token_id < EOS_TOKEN_ID:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {VOCAB_SIZE})")
        out.append(token_id)
    return bytes(out)
