"""SmolLM2 behind the OpenAI API, in real processes: chat (plain and streaming) and models through the
official `openai` client on the proxy and on an instance; P/D answers, answers partly recomputed after
injected corruption, and D's own local prefill all equal the in-process greedy reference."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvferry.engine.loader import SMOLLM2_NAME, LoadedModel, load_model
from procs import pd_system

MAX_TOKENS = 12
FAULTS = "corrupt=0.5,seed=3"  # D recomputes exactly the corrupted blocks
QUESTIONS = [
    "In two short sentences, explain why the sky is blue and why sunsets look red or orange to us.",
    "Give one practical tip for someone who wants to learn to cook simple, healthy meals at home.",
    "What is the capital of France, and which river flows through it? Answer in one sentence.",
    "Name a planet in our solar system that has rings, and say one fact about it in one sentence.",
    "Write one friendly sentence that welcomes a new colleague to a small software team on Monday.",
    "What does a bee collect from flowers, and what does it make from it? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model("smollm2")


def reference(smol: LoadedModel, question: str) -> str:
    prompt = smol.codec.apply_chat_template([{"role": "user", "content": question}])
    ids = smol.codec.encode(prompt)
    return smol.codec.decode(smol.model.generate_greedy(ids, MAX_TOKENS, eos_token_id=smol.codec.eos_token_id))


def chat(url: str, question: str, **extra: object) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}], "max_completion_tokens": MAX_TOKENS,
            "temperature": 0, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def test_real_model_pd_chat_recompute_and_openai_client(smol: LoadedModel) -> None:
    model_args = ("--model", "smollm2", "--faults", FAULTS, "--num-blocks", "128")
    d_args = (*model_args, "--kv-load-failure-policy", "recompute")
    # P runs 3 tensor-parallel ranks (one per KV head), D one: the head mapping is exercised too.
    with pd_system(p_tp=3, p_args=model_args, d_args=d_args, timeout=120) as (_p, d, proxy):
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list()] == [SMOLLM2_NAME, "smollm2"]  # its name, and --model

        expected = reference(smol, QUESTIONS[2])
        assert "Paris" in expected
        answer = client.chat.completions.create(
            model=SMOLLM2_NAME, messages=[{"role": "user", "content": QUESTIONS[2]}],
            max_completion_tokens=MAX_TOKENS, temperature=0,
        )  # fmt: skip
        assert answer.choices[0].message.content == expected
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage is not None and answer.usage.completion_tokens <= MAX_TOKENS

        stream = client.chat.completions.create(
            model=SMOLLM2_NAME, messages=[{"role": "user", "content": QUESTIONS[2]}],
            max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        )  # fmt: skip
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == expected

        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        assert info.value.code == "model_not_found"
        local = openai.OpenAI(base_url=f"{d.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            local.completions.create(model="no-such-model", prompt="hi")

        # P/D with corruption injected on about half the transfers: every answer equals the reference,
        # both a clean pull and a partial recompute are seen. The proxy's transfer ids are random, so each
        # request is a coin toss: up to 4 rounds of the questions (missing one outcome: 2 * 0.5**24).
        seen = set()
        for question in QUESTIONS * 4:
            r = chat(proxy.url, question)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == reference(smol, question)
            seen.add(r.json()["kvferry"]["recomputed_tokens"] > 0)
            if seen == {True, False}:
                break
        assert seen == {True, False}

        # D prefilling locally (no kv_transfer_params) gives the same answer too.
        r = chat(d.url, QUESTIONS[0])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == reference(smol, QUESTIONS[0])


def test_proxy_errors_and_headers_match_an_instance() -> None:
    with pd_system() as (_p, d, proxy):
        for url in (d.url, proxy.url):
            # No content-type: the same 400 from both.
            r = httpx.post(f"{url}/v1/chat/completions", content=b'{"messages": []}', timeout=30)
            assert r.status_code == 400, (url, r.text)
        bodies = [httpx.post(f"{u}/v1/completions", content=b"{}", timeout=30).json() for u in (d.url, proxy.url)]
        assert bodies[0] == bodies[1]
        wrong = [chat(u, "hi", model="nope") for u in (d.url, proxy.url)]
        assert [w.status_code for w in wrong] == [404, 404]
        assert wrong[0].json() == wrong[1].json()
        r = chat(proxy.url, "hi", stream=False)
        assert r.status_code == 200
        for name in ("date", "server"):
            assert len(r.headers.get_list(name)) <= 1, r.headers
        assert httpx.get(f"{proxy.url}/v1/models", timeout=30).json()["data"][0]["id"] == "kvferry-tiny-llama"
