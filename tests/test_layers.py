"""The package layout is a contract: imports point only left, nothing in the core imports the harness, no
module reaches itself through its imports (function-level imports count), and every file stays small."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvferry"
# What each package may import from kvferry (besides itself).
ALLOWED = {
    "transfer": set(),
    "connector": {"transfer"},
    "engine": {"connector", "transfer"},
    "serving": {"engine", "connector", "transfer"},
    "integrations": {"connector", "transfer"},
    "harness": {"serving", "engine", "connector", "transfer"},
    "bench": {"harness", "serving", "engine", "connector", "transfer"},
}


def _kvferry_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvferry."):
            out.add(node.module.removeprefix("kvferry."))
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("kvferry.") for a in node.names if a.name.startswith("kvferry.")}
    return out


def test_package_root_holds_only_the_entry_points() -> None:
    loose = sorted(p.name for p in SRC.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py"]


def test_imports_point_only_left() -> None:
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in (SRC / package).rglob("*.py"):
            for module in _kvferry_imports(path):
                top = module.split(".")[0]
                if top != package and top not in allowed and module not in allowed:
                    wrong.append(f"{path.relative_to(SRC)} imports kvferry.{module}")
    assert not wrong, "\n".join(wrong)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for module in _kvferry_imports(path):
            full = f"kvferry.{module}"
            targets.add(full if full in modules else full.rsplit(".", 1)[0])
        graph[name] = {t for t in targets if t in modules and t != name}
    # `from kvferry.x import y` where y is a module counts as importing y.
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvferry"):
                graph[name] |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return graph


def test_no_import_circles() -> None:
    graph = _graph()
    circles = []
    # A module is in a circle when it can reach itself: a depth-first search from each one.
    for start in graph:
        seen: set[str] = set()
        stack = list(graph[start])
        while stack:
            node = stack.pop()
            if node == start:
                circles.append(start)
                break
            if node not in seen:
                seen.add(node)
                stack.extend(graph[node])
    assert not circles, "modules that import themselves through others: " + ", ".join(sorted(circles))


def test_files_stay_small() -> None:
    big = [f"{p.relative_to(SRC)}: {n}" for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400]
    assert not big, big


def test_transfer_top_level_holds_the_shared_core_only() -> None:
    top = sorted(p.name for p in (SRC / "transfer").glob("*.py"))
    assert len(top) <= 10, top


def test_kvferry_instances_start_in_the_one_system_module() -> None:
    # A role can hide in a variable, so no `ManagedProcess(...)` call and no "--role" flag may appear
    # anywhere else in src: every rig of the harness and the benches goes through harness/system.py.
    allowed = {SRC / "harness" / "system.py", SRC / "cli.py"}
    wrong = []
    for path in SRC.rglob("*.py"):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                hit = (func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")) == "ManagedProcess"
            else:
                hit = isinstance(node, ast.Constant) and node.value == "--role"
            if hit:
                wrong.append(f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}")
    assert not wrong, "kvferry instances started outside harness/system.py: " + ", ".join(wrong)


# Comments and docstrings say why, in the present tense: an issue number or a day is history, which git keeps.
HISTORY = re.compile(r"\bissues? \d+|#\d{2,}|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                found.append((first.lineno, first.value.value))
    return found


def test_no_issue_numbers_or_dates_in_src() -> None:
    wrong = [f"{path.relative_to(SRC)}:{line}: {match.group()}"
             for path in SRC.rglob("*.py")
             for line, text in _comments_and_docstrings(path)
             for match in HISTORY.finditer(text)]
    assert not wrong, "issue numbers or dates in comments/docstrings (say why, not when): " + ", ".join(wrong)


# Each setting's default has one home, the config record of the lowest layer that owns it (`ConsumerConfig`,
# `PDConfig`, `SchedulerConfig`, `EngineConfig`, `ProxyConfig`); CLI flags, vLLM's settings and the harness read it by
# field. A literal default is a record field, an argparse `default=` or a `.get(key, default)`.
SETTINGS = {"abort_timeout_s", "kv_load_deadline_s", "recv_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s",
            "heartbeat_ceiling_s", "bootstrap_port", "bootstrap_timeout_s", "block_size", "progressive_push",
            "progressive_min_tokens", "num_blocks", "max_prefill_chunk", "max_num_seqs", "max_num_batched_tokens",
            "kv_load_failure_policy", "checksums", "control_port", "data_port", "advertise_host", "dealer_idle_s",
            "tp_size", "retries", "retry_unreachable", "health_interval_s"}
# The engine does not import `PDConfig` (it would load the connector's servers): block size's one pair.
TWO_HOMES = {"block_size": {"engine/scheduler.py", "connector/config.py"}}


def _literal_defaults(path: Path) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            found += [(s.target.id, s.lineno) for s in node.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                      and isinstance(s.value, ast.Constant) and s.value.value is not None]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            attr = getattr(node.func, "attr", "")
            if attr == "add_argument":
                found += [(str(node.args[0].value), node.lineno) for kw in node.keywords
                          if kw.arg == "default" and isinstance(kw.value, ast.Constant) and kw.value.value is not None]
            elif attr == "get" and len(node.args) == 2 and isinstance(node.args[1], ast.Constant):
                found.append((str(node.args[0].value), node.lineno))
    return found


def test_each_default_is_written_once() -> None:
    homes: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        for name, line in _literal_defaults(path):
            name = name.lstrip("-").replace("-", "_")
            setting = next((s for s in (name, f"{name}_s") if s in SETTINGS), None)
            if setting:
                homes.setdefault(setting, []).append(f"{path.relative_to(SRC)}:{line}")
    wrong = {name: places for name, places in homes.items()
             if len(places) > 1 and {p.split(":")[0] for p in places} != TWO_HOMES.get(name)}
    assert not wrong, f"defaults written in more than one place (read the home's field instead): {wrong}"


def test_serve_flags_default_to_the_config_records() -> None:
    from kvferry.cli import build_parser
    from kvferry.connector.config import PDConfig
    from kvferry.connector.decode.pulls import ConsumerConfig
    from kvferry.engine.engine import EngineConfig
    from kvferry.engine.scheduler import SchedulerConfig
    from kvferry.serving.proxy import ProxyConfig

    args = build_parser().parse_args(["serve"])
    pd, engine = PDConfig(role="decode", engine_id="e"), EngineConfig()
    assert pd.block_size == SchedulerConfig.block_size == engine.block_size == args.block_size
    assert pd.recv_timeout_s == ConsumerConfig().recv_timeout_s
    for flag, field in (("abort_timeout", "abort_timeout_s"), ("kv_load_deadline", "kv_load_deadline_s"),
                        ("heartbeat_interval", "heartbeat_interval_s"), ("heartbeat_timeout", "heartbeat_timeout_s"),
                        ("heartbeat_ceiling", "heartbeat_ceiling_s"), ("bootstrap_timeout", "bootstrap_timeout_s"),
                        ("bootstrap_port", "bootstrap_port"), ("transfer", "transfer"), ("tp", "tp_size"),
                        ("progressive_min_tokens", "progressive_min_tokens"), ("host", "host")):
        assert getattr(args, flag) == getattr(pd, field), flag
    for flag in ("num_blocks", "max_prefill_chunk", "kv_load_failure_policy", "seed"):
        assert getattr(args, flag) == getattr(engine, flag), flag
    proxy = build_parser().parse_args(["proxy", "--prefill", "p", "--decode", "d"])
    assert (proxy.retries, proxy.retry_unreachable, proxy.health_interval, proxy.migrations) == (
        ProxyConfig.retries, ProxyConfig.retry_unreachable, ProxyConfig.health_interval_s, ProxyConfig.migrations)
