"""The weight manifest: the names and shapes an engine accepts, built from a model's config alone."""

from __future__ import annotations

from rollout_sdk.protocol import TensorMeta
from rollout_sdk.weights.manifest import check_metas, hf_parameter_shapes, parameter_shapes


def test_manifest_from_config_matches_the_loaded_model(tiny_model) -> None:
    from transformers import AutoModelForCausalLM

    from_config = hf_parameter_shapes(str(tiny_model))
    loaded = parameter_shapes(AutoModelForCausalLM.from_pretrained(str(tiny_model)))
    assert from_config == loaded
    assert "model.embed_tokens.weight" in from_config and "model.norm.weight" in from_config
    # a tied head is accepted under the name a trainer's state_dict uses for it
    assert from_config["lm_head.weight"] == from_config["model.embed_tokens.weight"]


def test_check_names_every_problem_and_passes_a_good_update(tiny_model) -> None:
    shapes = hf_parameter_shapes(str(tiny_model))
    good = [[TensorMeta(name=n, dtype="bfloat16", shape=list(s)) for n, s in shapes.items()]]
    assert check_metas(shapes, good) == []
    hidden = shapes["model.norm.weight"][0]
    bad = [
        [TensorMeta(name="model.norm.weight", dtype="bfloat16", shape=[hidden])],
        [
            TensorMeta(name="model.layers.0.mlp.gate_projj.weight", dtype="bfloat16", shape=[4]),
            TensorMeta(name="model.norm.weight", dtype="bfloat16", shape=[hidden + 1]),
        ],
    ]
    problems = check_metas(shapes, bad)
    assert problems == [
        "unknown parameter 'model.layers.0.mlp.gate_projj.weight'",
        f"parameter 'model.norm.weight': shape ({hidden + 1},) does not match ({hidden},)",
    ]
    many = [[TensorMeta(name=f"x{i}", dtype="bfloat16", shape=[1]) for i in range(50)]]
    assert len(check_metas(shapes, many)) == 5
