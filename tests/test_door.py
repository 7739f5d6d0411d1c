"""Two doors (issue 38): a trainer's ``import rollout_sdk`` loads the trainer's side only; the engine side
(server, engines, weights, models) loads when first named, and imports torch at the top."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import rollout_sdk

#: the most rollout_sdk modules ``import rollout_sdk`` may load (30 when this was written)
MAX_ROOT_MODULES = 32
ENGINE_SIDE = ("rollout_sdk.server", "rollout_sdk.engines", "rollout_sdk.weights", "rollout_sdk.models")


def _fresh(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter (this one has imported everything already) and read its JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_trainers_door_loads_no_torch_and_no_engine_side_module() -> None:
    seen = _fresh(
        "import json, sys, rollout_sdk\n"
        "mods = sorted(m for m in sys.modules if m.startswith('rollout_sdk'))\n"
        "print(json.dumps({'mods': mods, 'torch': 'torch' in sys.modules,"
        " 'transformers': 'transformers' in sys.modules}))\n"
    )
    mods = seen["mods"]
    assert isinstance(mods, list)
    assert len(mods) <= MAX_ROOT_MODULES, mods
    assert [m for m in mods if m.startswith(ENGINE_SIDE)] == []
    assert (seen["torch"], seen["transformers"]) == (False, False)


def test_engine_side_names_load_when_named_and_are_the_engines_own() -> None:
    seen = _fresh(
        "import json, sys, rollout_sdk\n"
        "before = 'rollout_sdk.engines.cpu' in sys.modules\n"
        "from rollout_sdk import CpuEngine, Engine, EngineLoad, EngineServer, ServerConfig\n"
        "import rollout_sdk.engines.cpu as cpu, rollout_sdk.engines.base as base, rollout_sdk.server as server\n"
        "same = [CpuEngine is cpu.CpuEngine, Engine is base.Engine, EngineLoad is base.EngineLoad,"
        " EngineServer is server.EngineServer, ServerConfig is server.ServerConfig]\n"
        "print(json.dumps({'before': before, 'same': same, 'torch': 'torch' in sys.modules,"
        " 'in_dir': sorted({'CpuEngine', 'EngineServer'} & set(dir(rollout_sdk)))}))\n"
    )
    assert seen["before"] is False
    assert seen["same"] == [True] * 5
    assert seen["torch"] is True  # the engine side imports torch at the top, as its own door
    assert seen["in_dir"] == ["CpuEngine", "EngineServer"]


def test_an_unknown_root_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = rollout_sdk.NoSuchThing  # type: ignore[attr-defined]


def test_every_error_class_of_the_package_is_in_the_tree_and_a_rollout_error() -> None:
    """errors.py draws the whole tree (issue 38): the classes that live beside their layer are in it too."""
    from rollout_sdk import errors
    from rollout_sdk.agents.chat import TemplateError
    from rollout_sdk.agents.tools.definition import ToolArgumentError
    from rollout_sdk.export import ExportError
    from rollout_sdk.gateway.errors import GatewayError

    for cls in (ExportError, TemplateError, ToolArgumentError, GatewayError):
        assert issubclass(cls, errors.RolloutError), cls
        assert f"── {cls.__name__}" in (errors.__doc__ or ""), cls
    assert issubclass(ExportError, ValueError)
