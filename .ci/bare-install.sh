#!/usr/bin/env bash
# The base install works (issue 21.1): the wheel, installed with no extras into a fresh venv, serves the
# tiny model (a completion and a chat completion), and importing the vLLM adapter without vLLM says so
# clearly. Run from the repository root; uses only Python and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=$(mktemp -d)
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
SERVER=""
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
python3 -m pip wheel -q --no-deps -w "$WORK/wheel" . >/dev/null
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$WORK"/wheel/kvferry-*.whl
"$WORK/venv/bin/kvferry" --version
env -u KVFERRY_SECRET "$WORK/venv/bin/kvferry" serve --port "$PORT" >"$WORK/serve.log" 2>&1 &
SERVER=$!
"$WORK/venv/bin/python" - "$PORT" <<'PY'
import sys, time, httpx
url = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 120
while True:
    try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    assert time.monotonic() < deadline, "kvferry serve from the bare wheel never became healthy"
    time.sleep(0.2)
r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=60)
assert r.status_code == 200, r.text
r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
               json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
assert r.status_code == 200, r.text
try:  # what vLLM does with kv_connector_module_path: the module, then the class by name
    from kvferry.integrations.vllm import KVFerryConnector  # noqa: F401
except ImportError as exc:
    assert "needs vLLM" in str(exc), exc
else:
    raise AssertionError("kvferry.integrations.vllm's KVFerryConnector imported without vLLM installed")
print("bare install: kvferry serve answered a completion and a chat completion; the vLLM adapter says it needs vLLM")
PY
