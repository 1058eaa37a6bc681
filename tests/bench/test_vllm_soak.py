"""`kvferry bench vllm --soak`: the parts that need no vLLM. Its servers survive the SIGUSR1 of a stall's
evidence (the sitecustomize turns it into a stack dump), the watchdog reads a process group's threads,
and the summary counts outcomes as the table says. The soak itself: `kvferry bench vllm --soak 2`
(about 10 minutes here, most of it starting three vLLM servers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

from kvferry.bench.vllm.soak import summary_row
from kvferry.bench.vllm.soak_watch import Stall, Watchdog, threads_of, write_sitecustomize


def test_a_server_dumps_its_stacks_on_sigusr1_and_lives_on(tmp_path: Path) -> None:
    site = write_sitecustomize(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import sys, time\nprint('up', flush=True)\nwhile True: time.sleep(0.05)\n"
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        assert any(f"pid {child.pid} " in line for line in threads_of(child.pid))
        child.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert child.poll() is None  # without the handler SIGUSR1 would have killed it
    finally:
        child.kill()
        _, err = child.communicate()
    assert "Thread 0x" in err or "Current thread 0x" in err


def test_summary_counts_each_outcome_once() -> None:
    results = [("ok, same text", 1.0), ("ok (unchecked)", 2.0), ("DIFFERENT TEXT", 3.0),
               ("HTTP 500: Internal server error", 4.0), ("client ReadTimeout", 400.0)]
    row = summary_row(1, "transport=0.1", results, Counter({"transport": 1}), stalls=1, load="1 / 2 / 3")
    assert (row["requests"], row["ok"], row["same text (checked)"]) == (5, 2, "1 of 2")
    assert row["failed by outcome"] == "DIFFERENT TEXT 1; HTTP 500: Internal server error 1; client ReadTimeout 1"
    assert (row["max s"], row["> 300 s"], row["stalls > 60 s"]) == (400.0, 1, 1)


def test_a_stall_answered_while_its_evidence_is_taken_keeps_its_outcome(tmp_path: Path) -> None:
    dog = Watchdog(*cast(Any, (None, None, None)), "model", tmp_path)
    dog.begin(7, "prompt")
    dog.in_flight[7].flagged = True  # the watchdog saw it late and is taking the evidence
    dog.end(7, "HTTP 500: x", 81.0)  # answered meanwhile
    dog.stalls[7] = Stall(7, 62.0, "stall-7.txt", "summary")  # the capture ends
    assert [(s.outcome, s.latency_s) for s in dog.outcomes()] == [("HTTP 500: x", 81.0)]
