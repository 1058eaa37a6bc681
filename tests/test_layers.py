"""The package layout is a contract: imports point only left, and nothing in the core imports the harness."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvferry"
# What each package may import from kvferry (besides itself).
ALLOWED = {
    "transfer": set(),
    "connector": {"transfer", "engine.request"},
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
