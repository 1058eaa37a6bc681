"""The colocated reference for demo and chaos: `generate_greedy` in a side process at nice 10 (the system
under test gets the CPU first), with the instances' BLAS thread count (greedy outputs are bit-identical
only for one)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence

from kvferry.harness.client import WorkItem
from kvferry.harness.processes import blas_env


class ReferenceWorker:
    """Items go to the child as JSON lines; a reader thread collects its `{"index", "text"}` answers."""

    def __init__(self, seed: int, blas_threads: int, model: str = "tiny") -> None:
        self.results: dict[int, str] = {}
        self.expected = 0
        self.error: str | None = None
        self._done = threading.Event()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvferry.harness.reference", "--seed", str(seed), "--model", model],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            env={**os.environ, **blas_env(blas_threads)})
        self._reader = threading.Thread(target=self._read, name="kvferry-reference", daemon=True)
        self._reader.start()

    def submit(self, items: Iterable[WorkItem]) -> None:
        """Hand the items to the child (from a thread: the pipe may be smaller than the workload)."""
        lines = [json.dumps({"index": item.index, "prompt": item.prompt, "max_tokens": item.max_tokens,
                             "ignore_eos": item.ignore_eos}) + "\n" for item in items]
        self.expected = len(lines)
        threading.Thread(target=self._write, args=("".join(lines).encode(),), daemon=True).start()

    def _write(self, data: bytes) -> None:
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(data)
            self.popen.stdin.close()
        except (BrokenPipeError, OSError, ValueError) as exc:
            self.error = f"reference process input: {exc!r}"

    def _read(self) -> None:
        assert self.popen.stdout is not None
        try:
            for raw in self.popen.stdout:
                answer = json.loads(raw)
                self.results[int(answer["index"])] = str(answer["text"])
        except (ValueError, KeyError, OSError) as exc:
            self.error = f"reference process output: {exc!r}"
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """True once the child answered everything and exited."""
        finished = self._done.wait(timeout)
        if finished:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.popen.wait(timeout=5)
                if code != 0 and self.error is None:
                    self._stderr.seek(0)
                    tail = self._stderr.read().decode(errors="replace")[-2000:]
                    self.error = f"reference process exited with {code}: {tail}"
        return finished

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._stderr.close()


def _reference_main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvferry.harness.reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args(argv)
    with contextlib.suppress(OSError):
        os.nice(10)
    from kvferry.engine.loader import load_model

    loaded = load_model(args.model, args.seed)
    model, codec = loaded.model, loaded.codec
    # Read everything first, so the parent's writes never wait on a busy child.
    items = [json.loads(raw) for raw in sys.stdin.read().splitlines() if raw.strip()]
    for item in items:
        tokens = model.generate_greedy(item["prompt"], int(item["max_tokens"]),
                                       stop_at_eos=not item["ignore_eos"], eos_token_id=codec.eos_token_id)
        sys.stdout.write(json.dumps({"index": item["index"], "text": codec.decode(tokens)}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_reference_main(sys.argv[1:]))
