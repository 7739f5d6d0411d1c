"""The public surface: what `__all__` promises exists, is documented, and importing starts nothing."""

from __future__ import annotations

import subprocess
import sys

import rollout_sdk
from rollout_sdk import errors, protocol

EXPECTED = {
    "RolloutClient",
    "ClientConfig",
    "ClientStats",
    "ServerStatus",
    "GenerateRequest",
    "GenerateResult",
    "SamplingParams",
    "Group",
    "ResultStream",
    "EngineServer",
    "ServerConfig",
    "SchedulerConfig",
    "Engine",
    "EngineLoad",
    "CpuEngine",
    "CpuEngineConfig",
    "Discovery",
    "StaticServers",
    "EmbeddedServers",
    "Policy",
    "LeastLoad",
    "RoundRobin",
    "AdmissionConfig",
    "AdmissionController",
    "Credentials",
    "JobSecret",
    "ServerAuth",
    "__version__",
}


def test_all_is_exact_and_importable() -> None:
    exported = set(rollout_sdk.__all__)
    assert exported >= EXPECTED
    assert set(errors.__all__) - {"error_code", "error_from_reply"} <= exported
    for name in rollout_sdk.__all__:
        assert hasattr(rollout_sdk, name), name
    assert len(set(rollout_sdk.__all__)) == len(rollout_sdk.__all__)


def _public_members(module: object) -> set[str]:
    """Every public name a module holds that is not a submodule (httpx's test_exported_members)."""
    import types

    # dir(), not vars(): the root names its engine-side classes lazily (PEP 562 __getattr__ and __dir__)
    return {
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    } | {n for n in getattr(module, "__all__", ()) if n.startswith("__")}


def test_all_is_exactly_the_public_members() -> None:
    import rollout_sdk.agents
    import rollout_sdk.rollouts

    for module in (rollout_sdk, rollout_sdk.agents, rollout_sdk.rollouts):
        assert sorted(module.__all__) == sorted(_public_members(module)), module.__name__
    assert set(rollout_sdk.__all__) == EXPECTED | set(errors.__all__) - {"error_code", "error_from_reply"} | {
        "USE_CLIENT_DEFAULT",
        "ClientState",
        "Continuation",
        "GenerateAgent",
        "RolloutBatch",
        "RolloutStream",
    }


def test_public_names_have_docstrings() -> None:
    for name in rollout_sdk.__all__:
        obj = getattr(rollout_sdk, name)
        if isinstance(obj, type):
            assert obj.__doc__, f"{name} has no docstring"


def test_every_error_is_a_rollout_error() -> None:
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, errors.RolloutError), name


def test_protocol_all_names_exist() -> None:
    for name in protocol.__all__:
        assert hasattr(protocol, name), name


def test_import_has_no_side_effects() -> None:
    code = (
        "import asyncio, sys, threading\n"
        "before = threading.active_count()\n"
        "import rollout_sdk, rollout_sdk.launch.cli, rollout_sdk.demos.generate\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "assert threading.active_count() == before, 'a thread started'\n"
        "assert 'uvloop' not in type(asyncio.get_event_loop_policy()).__module__, 'loop policy changed'\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout
