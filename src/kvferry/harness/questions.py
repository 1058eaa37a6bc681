"""A real model's workload: short chat questions through its chat template, as token ids, so the proxy,
P, D and the reference all see the same prompt."""

from __future__ import annotations

import random

from kvferry.engine.text import TextCodec
from kvferry.harness.client import WorkItem

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 plus 30?",
    "Which planet is known as the red planet?", "Give me one tip for sleeping better.", "What do bees make?",
    "Translate 'good morning' into Spanish.", "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?", "What is the largest ocean on Earth?", "Write a haiku about the sea.",
    "Why is the sky blue? Answer in one sentence.", "What gas do plants take in from the air?",
    "Suggest a name for a friendly robot.", "How many legs does a spider have?",
    "What is the opposite of 'ancient'?",
]
# Prepended to some questions so that a few prompts span many KV blocks.
CONTEXT = (
    "Here is some background. The Rhine is a major European river that begins in the Swiss Alps, forms "
    "part of the borders of Switzerland, Liechtenstein, Austria, Germany and France, and flows north "
    "through Germany and the Netherlands into the North Sea. Cities along it include Basel, Strasbourg, "
    "Cologne and Rotterdam. It has been an important trade route since Roman times. "
)
CONTEXT_QUESTIONS = ["Into which sea does the Rhine flow?", "Name two cities on the Rhine.", "Where does the Rhine begin?"]


def chat_workload(codec: TextCodec, n: int, seed: int, max_tokens: tuple[int, int]) -> list[WorkItem]:
    """n chat requests, deterministic in (n, seed); every third one is about a long context (~110 tokens)."""
    rng = random.Random(seed)
    order = rng.sample(range(len(QUESTIONS)), len(QUESTIONS))
    items = []
    for i in range(n):
        question = QUESTIONS[order[i % len(order)]]
        if i % 3 == 2:
            question = CONTEXT + CONTEXT_QUESTIONS[(i // 3) % len(CONTEXT_QUESTIONS)]
        ids = codec.encode(codec.apply_chat_template([{"role": "user", "content": question}]))
        items.append(WorkItem(i, ids, rng.randint(*max_tokens), ignore_eos=False, question=question))
    return items
