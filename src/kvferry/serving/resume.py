"""Resuming a stream on another instance (the proxy's decode migration).

The proxy asks with `kvferry_resume: {"token_ids": [...], "text_sent": N}`; the instance recomputes
prompt + those tokens (bit for bit what the dead D had), samples on with the same seed, and streams only
the text after the first N characters, so no token is repeated or lost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.engine.text import TextCodec

RESUME_FIELD = "kvferry_resume"
TOKEN_IDS_FIELD = "kvferry_token_ids"  # a request asking each chunk to carry its token ids


class ResumeError(ValueError):
    pass


@dataclass(frozen=True)
class Resume:
    token_ids: list[int]
    text_sent: int


def parse_resume(extra: dict[str, Any], vocab_size: int, max_tokens: int) -> Resume | None:
    raw = extra.get(RESUME_FIELD)
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"token_ids", "text_sent"}:
        raise ResumeError(f"{RESUME_FIELD} must be an object with token_ids and text_sent")
    ids, sent = raw.get("token_ids"), raw.get("text_sent")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise ResumeError(f"{RESUME_FIELD}.token_ids must be a list of token ids in [0, {vocab_size})")
    if len(ids) >= max_tokens:
        raise ResumeError(f"{RESUME_FIELD}.token_ids ({len(ids)}) must be fewer than max_tokens ({max_tokens})")
    if type(sent) is not int or sent < 0:
        raise ResumeError(f"{RESUME_FIELD}.text_sent must be a non-negative integer")
    return Resume(list(ids), sent)


class TextAssembler:
    """Tokens → text, holding back EOS and cutting at the first stop string."""

    def __init__(self, codec: TextCodec, stop: tuple[str, ...], resume: Resume | None = None) -> None:
        self.stop = stop
        self.detokenizer = codec.detokenizer()
        self.text = ""
        self.sent = 0
        if resume is not None:  # the text of the resumed tokens, of which the client has `text_sent` chars
            self.add(resume.token_ids, False)
            if resume.text_sent > len(self.text):
                raise ResumeError(f"{RESUME_FIELD}.text_sent ({resume.text_sent}) is longer than the text of "
                                  f"its token_ids ({len(self.text)})")
            self.sent = resume.text_sent

    def add(self, token_ids: list[int], final: bool) -> str:
        self.text += self.detokenizer.push_many(token_ids)
        if final:
            self.text += self.detokenizer.finish()
        cut = min((i for s in self.stop if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
        # Hold back a tail that could still grow into a stop string.
        hold = 0 if final or cut >= 0 else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
