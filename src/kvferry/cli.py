"""`kvferry` command line: serve, proxy, demo, bench, chaos."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from kvferry.connector.auth import deployment_secret, is_loopback
from kvferry.connector.base import ConnectorRole, KVConnector
from kvferry.connector.bootstrap import LOOPBACK, PrefillAllowList
from kvferry.connector.config import PDConfig
from kvferry.connector.facade import PDConnector
from kvferry.connector.faults import FaultSpec
from kvferry.connector.metrics import Metrics
from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.loader import MODEL_CHOICES_HELP, ModelLoadError, load_model
from kvferry.serving.proxy import ProxyConfig, build_proxy_app
from kvferry.transfer.addr import join_addr
from kvferry.transfer.secret import env_ok, new_secret

MODEL_HELP = f"model: {MODEL_CHOICES_HELP}"


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run one instance (prefill, decode, or both colocated)")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                   help="prefill: computes KV and serves pulls; decode: pulls KV; both: colocated, no transfer")
    p.add_argument("--host", default=PDConfig.host, help="bind address of every listener (HTTP, ZMQ, data plane)")
    p.add_argument("--port", type=int, default=8100, help="HTTP API port")
    p.add_argument("--tp", type=int, default=PDConfig.tp_size, help="tensor-parallel ranks (KV heads sharded over them)")
    p.add_argument("--kv-load-failure-policy", choices=["fail", "recompute"], default=EngineConfig.kv_load_failure_policy,
                   help="decode side: a failed KV load ends the request with HTTP 500, or recomputes lost blocks")
    p.add_argument("--num-blocks", type=int, default=EngineConfig.num_blocks, help="KV blocks in the pool (64 KiB each by default)")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV block (P and D must agree)")
    p.add_argument("--max-prefill-chunk", type=int, default=EngineConfig.max_prefill_chunk,
                   help="chunked prefill: most prompt tokens one request computes per step (block-aligned; 0 = no cap)")
    p.add_argument("--progressive-push", action=argparse.BooleanOptionalAction, default=PDConfig.progressive_push,
                   help="prefill: a long prompt's KV goes to D while its prefill runs, as each step completes blocks")
    p.add_argument("--progressive-min-tokens", type=int, default=PDConfig.progressive_min_tokens,
                   help="prefill: shorter prompts are pushed once, after their prefill (docs/results.md)")
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may send as `model`, the first one reported (default: the model's own "
                        "name, and what --model was given)")
    p.add_argument("--seed", type=int, default=EngineConfig.seed, help="tiny model: weights seed (P, D and reference must agree)")
    p.add_argument("--bootstrap-port", type=int, default=PDConfig.bootstrap_port, help="prefill: HTTP port of the bootstrap server")
    p.add_argument("--control-port", type=int, default=PDConfig.control_port,
                   help="prefill: rank r's ZMQ control socket binds this + r (0: a port the kernel picks)")
    p.add_argument("--data-port", type=int, default=PDConfig.data_port,
                   help="rank r's TCP data plane binds this + r (0: a port the kernel picks)")
    p.add_argument("--advertise-host", default=None,
                   help="the address peers are told to dial (default: --host; needed when --host is 0.0.0.0 or ::)")
    p.add_argument("--transfer", choices=["tcp", "mooncake", "nixl"], default=PDConfig.transfer,
                   help="data-plane backend (nixl: pip install 'kvferry[nixl]'; loopback unless --insecure)")
    p.add_argument("--faults", default=os.environ.get("KVFERRY_FAULTS", ""),
                   help="fault injection, e.g. 'transport=0.1,corrupt=0.05,seed=1' (env KVFERRY_FAULTS)")
    p.add_argument("--abort-timeout", type=float, default=PDConfig.abort_timeout_s,
                   help="prefill: how long a pull waits for an unfinished prefill, and unpulled blocks are kept (s)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="SIGTERM or POST /drain: stop admitting, serve what is held, exit 0 within this (s; "
                        "default --abort-timeout: P's unpulled prefills expire by then). A second SIGTERM or SIGINT ends it")
    p.add_argument("--drain-grace", type=float, default=0.0,
                   help="draining: /health says 503 at least this long before the port closes (s; for load "
                        "balancers that only poll /health)")
    p.add_argument("--kv-load-deadline", type=float, default=PDConfig.kv_load_deadline_s,
                   help="decode: no request waits for remote KV longer than this (s)")
    p.add_argument("--heartbeat-interval", type=float, default=PDConfig.heartbeat_interval_s,
                   help="D → P liveness ping period (s)")
    p.add_argument("--heartbeat-timeout", type=float, default=PDConfig.heartbeat_timeout_s,
                   help="P silent this long = dead on an idle box (more while P's acks come late); 0 = off")
    p.add_argument("--heartbeat-ceiling", type=float, default=PDConfig.heartbeat_ceiling_s,
                   help="most a slow P is waited on, and most lease a lagging D asks for (s); "
                        "<= --heartbeat-timeout: fixed thresholds")
    p.add_argument("--no-checksums", action="store_true", help="skip per-block xxhash verification on D")
    p.add_argument("--engine-id", default=None, help="default: <role>-<advertised host>:<port>")
    p.add_argument("--prefill-allow", action="append", default=None, metavar="HOST_OR_CIDR[:PORT]",
                   help="decode: bootstrap servers D may pull from: a host or CIDR, any port unless one is "
                        "given ([IPv6]:PORT); repeatable; default loopback, any port")
    p.add_argument("--bootstrap-timeout", type=float, default=PDConfig.bootstrap_timeout_s,
                   help="decode: a bootstrap lookup fails after this, a refused one too (s; P must answer in it)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without KVFERRY_SECRET (anyone who reaches a port is trusted)")
    p.add_argument("--log-level", default="warning", help="debug, info, warning or error")


def _check_exposure(args: argparse.Namespace) -> bool:
    """No secret, no network: a non-loopback listener without KVFERRY_SECRET needs --insecure."""
    if is_loopback(args.host) or deployment_secret() is not None:
        return True
    if not args.insecure:
        print(f"kvferry serve: --host {args.host} is reachable from other machines, and KVFERRY_SECRET is not "
              "set: anyone who reaches a port could read prompts and forge answers. Set KVFERRY_SECRET on every "
              "P and D (docs/security.md), or pass --insecure on an isolated network.", file=sys.stderr)
        return False
    print(f"kvferry serve: WARNING: --insecure: listening on {args.host} without KVFERRY_SECRET; control and data "
          "planes are unauthenticated", file=sys.stderr, flush=True)
    return True


def _check_nixl(args: argparse.Namespace) -> bool:
    """NIXL/UCX authenticate nothing and a UCX peer can write anywhere in a process: loopback only,
    unless --insecure (docs/security.md)."""
    if args.transfer != "nixl" or args.role == "both":
        return True
    from kvferry.transfer.nixl import api as nixl_api

    if not nixl_api.available():
        print(f"kvferry serve: --transfer nixl: nixl is not installed ({nixl_api.INSTALL_HINT}): "
              f"{nixl_api.IMPORT_ERROR}", file=sys.stderr)
        return False
    if is_loopback(args.host):
        return True
    if not args.insecure:
        print(f"kvferry serve: --transfer nixl on --host {args.host}: UCX's listener accepts anyone who reaches it "
              "and a UCX peer can write anywhere in this process, whatever the grants and KVFERRY_SECRET say. "
              "Use --transfer tcp, or pass --insecure on a network where every host is trusted.", file=sys.stderr)
        return False
    print("kvferry serve: WARNING: --insecure --transfer nixl: UCX's data plane is open to every host that "
          "reaches it (docs/security.md)", file=sys.stderr, flush=True)
    return True


def _bound(bound: str, advertised: str) -> str:
    return "" if bound == advertised else f" (bound {bound})"


def _add_proxy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("proxy", help="P/D proxy: prefill on P, decode on D, one transfer_id")
    p.add_argument("--prefill", action="append", required=True, help="prefill instance URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="decode instance URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the proxy")
    p.add_argument("--retries", type=int, default=ProxyConfig.retries, help="retry a KV-load failure before the first token")
    p.add_argument("--migrations", type=int, default=ProxyConfig.migrations,
                   help="a stream whose D dies or aborts it is resumed on another D from the tokens already sent, "
                        "and a non-streamed answer a D aborted (shutting down) is asked of another D, at most this "
                        "many times (0 = off; resuming after text needs kvferry D instances)")
    p.add_argument("--health-interval", type=float, default=ProxyConfig.health_interval_s,
                   help="ask every instance in rotation /health this often; a draining (503) or unreachable one "
                        "leaves rotation until it answers 200 again (s; 0 = only on failed requests)")
    p.add_argument("--retry-unreachable", type=int, default=ProxyConfig.retry_unreachable,
                   help="retry (with backoff up to 2 s) when an instance cannot be reached at all")
    p.add_argument("--sequential", action="store_true",
                   help="prefill first, then pass P's kv_transfer_params to D (automatic for a P that is not kvferry)")
    p.add_argument("--log-level", default="warning", help="debug, info, warning or error")


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks; each prints a table and can write --json")
    p.add_argument("which", choices=["transfer", "failover", "lease", "scheduler", "e2e", "chunked", "model", "vllm", "serve",
                                        "load_faults", "flood", "progressive"], help="which benchmark (flood: requests under strangers' floods)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke runs)")
    p.add_argument("--model", default="smollm2", help="bench model, progressive: the model to measure (tiny, smollm2, a path)")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="bench model: BLAS / torch threads of both sides (1 keeps kvferry deterministic)")
    p.add_argument("--concurrency", default=None, metavar="N,N,...",
                   help="bench serve: concurrency levels (default 1,4,16,64; --quick 1,4)")
    p.add_argument("--poisson", type=float, default=None, metavar="RATE",
                   help="bench serve: Poisson arrivals at RATE requests/s (default: closed loop)")
    p.add_argument("--output-tokens", type=int, default=None, help="bench serve: tokens per answer (default 32)")
    p.add_argument("--vllm", action="store_true",
                   help="bench serve: also vLLM's client (vllm bench serve) against kvferry, and vllm serve under both")
    p.add_argument("--faults", action="store_true",
                   help="bench vllm: the fault matrix (kvferry and NixlConnector, fail and recompute) instead of latency")
    p.add_argument("--hogs", type=int, default=0, metavar="N",
                   help="bench vllm: P/D at vLLM's CPU defaults, alone then with N CPU-bound processes (false peer_dead)")
    p.add_argument("--soak", type=float, default=0, metavar="MINUTES", help="bench vllm: P/D, faults, 16 clients; stalls")
    p.add_argument("--workload", choices=["single", "multiturn"], default="single",
                   help="bench vllm: multiturn: conversations, D's prefix-cache hits (colocated, kvferry, NIXL)")


def _add_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("model", help="model files: export a real model as an HF safetensors directory")
    actions = p.add_subparsers(dest="model_command", required=True, help="export")
    export = actions.add_parser("export", help="write config, float32 safetensors, tokenizer and chat template",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    export.add_argument("name", help="smollm2, or a path to a GGUF file")
    export.add_argument("dir", help="target directory (must not exist yet); vLLM can serve it")


def model_command(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from kvferry.engine.loader import model_dir

    target = Path(args.dir)
    if target.exists():
        print(f"kvferry model export: {target} already exists", file=sys.stderr)
        return 2
    if args.name == "tiny":
        print("kvferry model export: the tiny model has no tokenizer files to export", file=sys.stderr)
        return 2
    try:
        source = model_dir(args.name)
    except (ModelLoadError, ValueError) as exc:
        print(f"kvferry model export: {exc}", file=sys.stderr)
        return 2
    shutil.copytree(source, target)
    print(f"kvferry model export: {args.name} -> {target}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvferry import __version__

    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvferry {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_proxy(sub)
    from kvferry.harness import demo

    demo.add_arguments(sub.add_parser("demo", help="run P, D and the proxy with faults; report; exit 0 if clean"))
    from kvferry.harness import chaos

    chaos.add_arguments(sub.add_parser("chaos", help="faults of every kind + kill/freeze P; exit 0 if clean"))
    from kvferry.harness import soak

    soak.add_arguments(sub.add_parser("soak", help="restarts, faults and steady load; fails if fds/threads/RSS/blocks grow"))
    _add_bench(sub)
    _add_model(sub)
    sub.add_parser("secret", help="print a fresh KVFERRY_SECRET (256 random bits, base64url)")
    for command in sub.choices.values():  # every --help shows each flag's default
        command.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    return parser


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvferry.serving.api_server import build_app
    from kvferry.serving.drain import Drain, DrainingServer
    from kvferry.serving.router_formats import EngineResolver

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not env_ok("kvferry serve") or not _check_exposure(args) or not _check_nixl(args):
        return 2
    if args.host in ("0.0.0.0", "::") and not args.advertise_host:
        print(f"kvferry serve: --host {args.host} binds every interface: say which address peers should dial "
              "with --advertise-host", file=sys.stderr)
        return 2
    advertised = args.advertise_host or args.host
    if args.transfer == "mooncake" and args.role != "both":
        print("kvferry serve: WARNING: --transfer mooncake: Mooncake TE authenticates nothing on the data plane "
              "(docs/security.md)", file=sys.stderr, flush=True)
    try:
        allow = PrefillAllowList(args.prefill_allow or LOOPBACK)
    except ValueError as exc:
        print(f"kvferry serve: {exc}", file=sys.stderr)
        return 2
    if args.bootstrap_timeout <= 0:
        print("kvferry serve: --bootstrap-timeout must be > 0", file=sys.stderr)
        return 2
    engine_id = args.engine_id or f"{args.role}-{advertised}:{args.port}"  # 0.0.0.0 would name every pod alike
    try:
        faults = FaultSpec.parse(args.faults)
    except ValueError as exc:
        print(f"kvferry serve: --faults: {exc}", file=sys.stderr)
        return 2
    try:
        loaded = load_model(args.model, args.seed)
    except ModelLoadError as exc:
        print(f"kvferry serve: --model: {exc}", file=sys.stderr)
        return 2
    heads = loaded.model.config.num_kv_heads
    if heads % args.tp:
        print(f"kvferry serve: --tp {args.tp} does not divide the model's {heads} KV heads", file=sys.stderr)
        return 2
    metrics = Metrics()
    scheduler_connector: KVConnector | None = None
    worker_connector: KVConnector | None = None
    if args.role != "both":
        pd_config = PDConfig(
            role=args.role, engine_id=engine_id, host=args.host, tp_size=args.tp, block_size=args.block_size,
            bootstrap_port=args.bootstrap_port, abort_timeout_s=args.abort_timeout,
            kv_load_deadline_s=args.kv_load_deadline, transfer=args.transfer, faults=faults,
            checksums=not args.no_checksums, heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout, heartbeat_ceiling_s=args.heartbeat_ceiling,
            prefill_allow=tuple(allow.entries), bootstrap_timeout_s=args.bootstrap_timeout,
            control_port=args.control_port, data_port=args.data_port, advertise_host=advertised,
            progressive_push=args.progressive_push, progressive_min_tokens=args.progressive_min_tokens)
        scheduler_connector = PDConnector(ConnectorRole.SCHEDULER, pd_config, metrics)
        worker_connector = PDConnector(ConnectorRole.WORKER, pd_config, metrics)
    config = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, seed=args.seed,
                          kv_load_failure_policy=args.kv_load_failure_policy,
                          max_prefill_chunk=args.max_prefill_chunk, role=args.role, engine_id=engine_id)
    extra = {"kv_bootstrap_addr": join_addr(advertised, args.bootstrap_port)} if args.role == "prefill" else {}
    engine = Engine(config, scheduler_connector, worker_connector, metrics, loaded)
    engine.start()
    names = args.served_model_name or [loaded.name, args.model]
    who = f"kvferry serve ({args.role}, {names[0]})"
    print(f"{who}: HTTP API on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    if args.role == "prefill":
        print(f"{who}: bootstrap server on http://{args.host}:{args.bootstrap_port}", file=sys.stderr, flush=True)
    if isinstance(worker_connector, PDConnector):
        stats = worker_connector.stats()
        for rank, (addr, bound) in enumerate(zip(stats["control_addrs"], stats["control_bound"], strict=True)):
            print(f"{who}: control (ZMQ) of rank {rank} on {addr}{_bound(bound, addr)}", file=sys.stderr, flush=True)
        for rank, (addr, bound) in enumerate(zip(stats["transfer_addrs"], stats["transfer_bound"], strict=True)):
            print(f"{who}: data plane ({args.transfer}) of rank {rank} on {addr}{_bound(bound, addr)}", file=sys.stderr,
                  flush=True)
    try:
        timeout = args.abort_timeout if args.drain_timeout is None else args.drain_timeout
        drain = Drain(engine.snapshot, timeout_s=timeout, grace_s=args.drain_grace)
        app = build_app(engine, extra, names, drain, EngineResolver(allow, args.bootstrap_timeout))
        server_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
        DrainingServer(server_config, drain).run()
    finally:
        engine.stop()
    return 0


def proxy(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_proxy_app(args.prefill, args.decode, retries=args.retries, sequential=args.sequential,
                          retry_unreachable=args.retry_unreachable, health_interval_s=args.health_interval,
                          migrations=args.migrations)
    print(f"kvferry proxy: HTTP API on http://{args.host}:{args.port} (prefill {', '.join(args.prefill)}; "
          f"decode {', '.join(args.decode)})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def bench(args: argparse.Namespace) -> int:
    # kvferry.bench.<which> each expose run(json_path, quick) and print their own table.
    if args.which == "model":
        # OpenBLAS fixes its thread count when it loads (numpy is loaded by now): start afresh with it.
        if os.environ.get("OPENBLAS_NUM_THREADS") != str(args.blas_threads):
            env = {**os.environ, "OPENBLAS_NUM_THREADS": str(args.blas_threads)}
            os.execve(sys.executable, [sys.executable, "-m", "kvferry", *sys.argv[1:]], env)
        from kvferry.bench import model as model_bench

        model_bench.run(args.json_path, quick=args.quick, model=args.model)
        return 0
    if args.which == "serve":
        from dataclasses import replace

        from kvferry.bench import serve as serve_bench

        plan = replace(serve_bench.QUICK if args.quick else serve_bench.ServePlan(), model=args.model,
                       poisson_rate=args.poisson, vllm=args.vllm)
        if args.concurrency:
            plan = replace(plan, concurrencies=tuple(int(c) for c in args.concurrency.split(",")))
        if args.output_tokens:
            plan = replace(plan, output_tokens=args.output_tokens)
        serve_bench.run(args.json_path, plan=plan)
        return 0
    if args.which == "vllm":
        from kvferry.bench.vllm import faults, multiturn, side_by_side, soak, starved

        if args.workload == "multiturn":
            multiturn.run(args.json_path, quick=args.quick)
        elif args.soak:
            soak.run(args.json_path, args.soak, quick=args.quick)
        elif args.hogs:
            starved.run(args.json_path, args.hogs, quick=args.quick)
        else:
            (faults if args.faults else side_by_side).run(args.json_path, quick=args.quick)
        return 0
    module = importlib.import_module(f"kvferry.bench.{args.which}")
    module.run(args.json_path, quick=args.quick, **({"model": args.model} if args.which == "progressive" else {}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "proxy":
        return proxy(args)
    if args.command in ("chaos", "soak", "demo"):
        return int(importlib.import_module(f"kvferry.harness.{args.command}").run(args))
    if args.command == "bench":
        return bench(args)
    if args.command == "model":
        return model_command(args)
    if args.command == "secret":
        print(new_secret())
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
