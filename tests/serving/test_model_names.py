"""vLLM's naming (issue 21.2): an instance answers to what `--model` was given and to the model's own
name, or to every `--served-model-name`; `/v1/models` lists them; any other name is 404."""

from __future__ import annotations

import httpx

from procs import running, serve


def ask(url: str, model: str, chat: bool = False) -> httpx.Response:
    if chat:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=30)


def test_default_names_are_the_model_flag_and_the_models_own_name() -> None:
    p = serve(None, "--model", "tiny")
    with running(p):
        listed = [m["id"] for m in httpx.get(f"{p.url}/v1/models").json()["data"]]
        assert listed == ["kvferry-tiny-llama", "tiny"]
        for name in listed:
            r = ask(p.url, name)
            assert r.status_code == 200 and r.json()["model"] == name, r.text
            assert ask(p.url, name, chat=True).status_code == 200
        assert ask(p.url, "gpt-4").json()["error"]["code"] == "model_not_found"


def test_served_model_names_replace_the_defaults() -> None:
    p = serve(None, "--served-model-name", "chat-small", "team/model")
    with running(p):
        assert [m["id"] for m in httpx.get(f"{p.url}/v1/models").json()["data"]] == ["chat-small", "team/model"]
        assert ask(p.url, "team/model").status_code == 200
        assert ask(p.url, "tiny").status_code == 404
