"""A vLLM P (vllm_harness's `Instance`, kv_producer) in a process of its own, so that a test can stop it
(SIGSTOP) while D reads its KV.

    python vllm_p_process.py MODEL_DIR EXTRA_CONFIG_JSON NUM_BLOCKS

Prints one JSON line when it serves (`engine_id`, `bootstrap_addr`), then for each JSON line on stdin
(`prompt`, `transfer_id`) prefills the prompt as a proxy asks P to (max_tokens 1) and prints the
`kv_transfer_params` P answers with. Its scheduler steps while it holds requests (D's pulls free their
blocks) and blocks on stdin otherwise; it exits when stdin closes."""

from __future__ import annotations

import json
import select
import sys

from vllm_harness import Instance


def main() -> None:
    model_dir, extra, num_blocks = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    p = Instance("P", model_dir, "kv_producer", extra, num_blocks=num_blocks)
    print(json.dumps({"engine_id": p.engine_id, "bootstrap_addr": p.bootstrap_addr}), flush=True)
    prefilling: list[str] = []
    try:
        while True:
            busy = bool(p.scheduler.requests)
            if select.select([sys.stdin], [], [], 0.005 if busy else 1.0)[0]:
                line = sys.stdin.readline()
                if not line:
                    return
                ask = json.loads(line)
                req = p.add(ask["prompt"], 1, {"do_remote_decode": True, "transfer_id": ask["transfer_id"]})
                prefilling.append(req.request_id)
            if p.scheduler.requests:
                p.step()
            for request_id in [r for r in prefilling if p.finished(r) is not None]:
                out = p.finished(request_id)
                assert out is not None
                print(json.dumps({"kv_transfer_params": out.kv_transfer_params}), flush=True)
                prefilling.remove(request_id)
    finally:
        p.close()


if __name__ == "__main__":
    main()
