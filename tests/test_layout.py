"""The package's shape: the root holds only the public face; the client's keywords land in its config once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import rollout_sdk
from rollout_sdk import USE_CLIENT_DEFAULT, AdmissionConfig, ClientConfig, RolloutClient, SchedulerConfig

ROOT = Path(rollout_sdk.__file__).parent

#: the reasons a function-local import may give, as a trailing comment (docs/design.md, "Imports inside
#: functions"): ``optional: <package>``, ``lazy: <path>``, ``door: <what>`` or ``cycle``
IMPORT_REASON = re.compile(r"#\s*(?:(?:optional|lazy|door):\s*[\w.-]+|cycle\b)")


def _unreasoned_imports(source: str) -> list[int]:
    """The line of each import inside a function body (nested ones too) whose lines carry no reason."""
    lines = source.splitlines()
    found: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                text = " ".join(lines[child.lineno - 1 : child.end_lineno])
                if not IMPORT_REASON.search(text):
                    found.append(child.lineno)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(source), False)
    return found


def test_the_package_root_holds_at_most_eight_modules() -> None:
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= 8, modules


def test_each_public_name_has_one_import_path() -> None:
    from rollout_sdk.client.metrics import ClientMetrics
    from rollout_sdk.discovery import Discovery, EmbeddedServers, StaticServers
    from rollout_sdk.discovery.store import ServerRecord, StoreDiscovery
    from rollout_sdk.export import iter_jsonl, write_jsonl
    from rollout_sdk.metrics import render_metrics, serve_metrics
    from rollout_sdk.server.metrics import ServerMetrics

    assert {Discovery, EmbeddedServers, StaticServers, iter_jsonl, write_jsonl, ServerRecord, StoreDiscovery}
    assert callable(render_metrics) and callable(serve_metrics) and ClientMetrics and ServerMetrics
    # no compatibility shims for paths of a package never released
    import rollout_sdk.launch

    assert not hasattr(rollout_sdk.metrics, "ClientMetrics") and not hasattr(rollout_sdk.metrics, "ServerMetrics")
    assert not hasattr(rollout_sdk.launch, "StoreDiscovery") and not hasattr(rollout_sdk.launch, "ServerRecord")


def test_client_keywords_replace_config_fields_in_one_place() -> None:
    base = ClientConfig(retries=3, scheduler=SchedulerConfig(max_waiting=7))
    adm = AdmissionConfig(min_queue=2)
    client = RolloutClient(
        servers=["tcp://127.0.0.1:9"], config=base, timeout_s=5.0, max_in_flight_per_server=4, admission=adm
    )
    cfg = client.config
    assert (cfg.retries, cfg.timeout_s) == (3, 5.0)  # kept from the config, replaced by the keyword
    assert (cfg.scheduler.max_waiting, cfg.scheduler.max_in_flight_per_server) == (7, 4)
    assert cfg.scheduler.admission is adm
    assert base.with_options(retries=USE_CLIENT_DEFAULT, policy=USE_CLIENT_DEFAULT) is base
    with pytest.raises(TypeError, match="unexpected keyword arguments: bogus, scheduler"):
        RolloutClient(servers=["tcp://127.0.0.1:9"], bogus=1, scheduler=SchedulerConfig())


def test_sglang_request_errors_map_in_one_place() -> None:
    from rollout_sdk import InvalidRequestError, RequestFailedError
    from rollout_sdk.engines.sglang.translate import request_error

    bad = request_error(ValueError("context length 9000 > 8192"), "sampling", "<sampling>")
    assert isinstance(bad, InvalidRequestError)
    assert (bad.field, bad.reason) == ("sampling", "context length 9000 > 8192")
    failed = request_error(RuntimeError("cuda oops"), "input_ids", "<3 tokens>", "score request")
    assert isinstance(failed, RequestFailedError)
    assert str(failed) == "SGLang failed the score request: RuntimeError: cuda oops"


def test_the_import_check_sees_imports_in_functions_only_and_reads_their_reason() -> None:
    source = (
        "import os\n"
        "def f():\n"
        "    import json\n"
        "    import sglang  # optional: sglang\n"
        "    from x import (  # door: torch\n"
        "        y,\n"
        "    )\n"
        "    import z  # noqa: F401  # lazy: cli-start\n"
        "    import w  # we need it later\n"
        "    import v  # optional\n"
        "    class C:\n"
        "        async def g(self):\n"
        "            from . import u\n"
        "            from . import t  # cycle\n"
    )
    assert _unreasoned_imports(source) == [3, 9, 10, 13]


def test_every_function_local_import_gives_its_reason() -> None:
    """Issue 38: imports go at the top, except where a dependency is optional, a path must stay light
    (the CLI's start, a cached model), the trainer's door must not load it, or an import cycle forbids it."""
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        source = path.read_text()
        lines = source.splitlines()
        missing += [f"{rel}:{n}: {lines[n - 1].strip()}" for n in _unreasoned_imports(source)]
    assert missing == [], "function-local imports without a reason (docs/design.md):\n" + "\n".join(missing)
