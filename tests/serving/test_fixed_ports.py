"""Fixed ports and an advertised address (issue 21.3): a firewall can open exactly the ports an instance
was told to use, and peers dial the advertised host, not the bound one."""

from __future__ import annotations

import subprocess
import sys

import httpx

from procs import free_port, pd_system

PROMPT = "Fixed ports let a firewall open exactly what kvferry uses. " * 2


def test_fixed_ports_and_advertised_host_end_to_end() -> None:
    control, p_data, d_data = free_port(), free_port(), free_port()
    p_args = ("--control-port", str(control), "--data-port", str(p_data), "--advertise-host", "localhost")
    d_args = ("--data-port", str(d_data), "--advertise-host", "localhost")
    with pd_system(p_args=p_args, d_args=d_args) as (p, d, proxy):
        ps = httpx.get(f"{p.url}/debug/state").json()["connector"]
        assert ps["control_addrs"] == [f"tcp://localhost:{control}"]
        assert ps["control_bound"] == [f"tcp://127.0.0.1:{control}"]
        assert ps["transfer_addrs"] == [f"localhost:{p_data}"]
        ds = httpx.get(f"{d.url}/debug/state").json()["connector"]
        assert ds["transfer_addrs"] == [f"localhost:{d_data}"] and ds["transfer_bound"] == [f"127.0.0.1:{d_data}"]
        assert httpx.get(f"{p.url}/health").json()["kv_bootstrap_addr"].startswith("localhost:")
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        pd = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
        assert pd.status_code == 200, pd.text
        local = httpx.post(f"{d.url}/v1/completions", json=body, timeout=60).json()
        assert pd.json()["choices"][0]["text"] == local["choices"][0]["text"]
        assert f"control (ZMQ) of rank 0 on tcp://localhost:{control} (bound tcp://127.0.0.1:{control})" in p.output_tail()


def test_every_interface_needs_an_advertised_host() -> None:
    run = subprocess.run([sys.executable, "-m", "kvferry", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
                         env={"KVFERRY_SECRET": "c2VjcmV0LW9mLWF0LWxlYXN0LTEyOC1iaXRz", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--advertise-host" in run.stderr, run.stderr
