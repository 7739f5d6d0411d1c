"""A tiny Qwen2.5-VL-shaped vision-language model made locally from a fixed seed, never downloaded.

Same recipe as :mod:`.tiny`: Qwen2.5's real token space (the vision special tokens ``<|vision_start|>``,
``<|image_pad|>``, ``<|vision_end|>`` included, ids 151652-151655), random weights re-drawn from our own
generator, built once into the atomic model cache.  The architecture is ``Qwen2_5_VLForConditionalGeneration``
with everything shrunk: a 2-layer 64-wide language model with multimodal RoPE (``mrope_section`` [2, 3, 3]
over a 16-wide head) and a 2-block 32-wide vision tower (14-pixel patches, 2x2 merge, temporal patch 2, one
windowed and one full-attention block).  ``preprocessor_config.json`` configures transformers'
``Qwen2VLImageProcessor`` with small pixel bounds (28x28 to 112x112 pixels after resizing: 1 to 16 image
tokens per image), so tests with small images stay fast on two cores.

``rollout-sdk make-model tiny-vl`` builds it; :func:`ensure_tiny_vl_model` returns its directory.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from ._cache import build_once, default_home
from .qwen_tokenizer import QWEN25_CHAT_TEMPLATE
from .tiny import GENERATION_CONFIG, TINY_LM_SHAPE, write_seeded_weights, write_tokenizer

__all__ = ["TINY_VL_CONFIG", "TINY_VL_PREPROCESSOR", "VL_CHAT_TEMPLATE", "ensure_tiny_vl_model", "noise_png"]

#: bump when the recipe changes, so an old cached directory is not reused (v2: the weights file in the
#: released checkpoints' layout, which SGLang's loader needs; the same values as v1)
_RECIPE = "v2"

_TEXT: dict[str, Any] = {
    "model_type": "qwen2_5_vl_text",
    **TINY_LM_SHAPE,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "tie_word_embeddings": True,
}
_VISION: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 2,
    "window_size": 56,
    "out_hidden_size": 64,
    "fullatt_block_indexes": [1],
    "hidden_act": "silu",
    "initializer_range": 0.02,
}
TINY_VL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "text_config": _TEXT,
    "vision_config": _VISION,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
#: Qwen2VLImageProcessor's settings (Qwen2.5-VL's published ones, pixel bounds shrunk)
TINY_VL_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 28 * 28,
    "max_pixels": 112 * 112,
    "size": {"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
}

#: Qwen2.5-Instruct's tool-calling template with Qwen2.5-VL's content lists: a message's content may be a
#: string or a list of parts, and an ``image`` / ``image_url`` part renders as Qwen2.5-VL's template renders
#: it (``<|vision_start|><|image_pad|><|vision_end|>``), in user, assistant and tool messages alike (a tool
#: result's image sits inside its ``<tool_response>`` block).
VL_CHAT_TEMPLATE: str = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}\n"
)


def _vl_template() -> str:
    body = QWEN25_CHAT_TEMPLATE
    for old, new in (
        ("messages[0]['content']", "render_content(messages[0]['content'])"),
        ("message.content", "render_content(message.content)"),
    ):
        body = body.replace(old, new)
    # "{%- if render_content(message.content) %}" keeps its meaning: empty content renders nothing
    return VL_CHAT_TEMPLATE + body


def ensure_tiny_vl_model(home: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Path:
    """Return the tiny VL model's directory, building it first if needed (seconds, offline)."""
    root = Path(home) if home is not None else default_home()
    dest = root / "models" / f"tiny-qwen2_5_vl-{_RECIPE}-seed{seed}"

    def build(tmp: Path) -> None:
        _write_model(tmp, seed)
        write_tokenizer(tmp)
        cfg_path = tmp / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = _vl_template()
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        (tmp / "preprocessor_config.json").write_text(json.dumps(TINY_VL_PREPROCESSOR, indent=2) + "\n")

    return build_once(dest, build, marker="preprocessor_config.json")


def _write_model(out: Path, seed: int) -> None:
    import torch  # lazy: build
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # lazy: build

    config = Qwen2_5_VLConfig(
        text_config=dict(_TEXT),
        vision_config=dict(_VISION),
        **{k: v for k, v in TINY_VL_CONFIG.items() if k not in ("text_config", "vision_config", "model_type")},
    )
    with torch.device("cpu"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    norms = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")
    write_seeded_weights(
        model, out, seed=seed, std=0.02, ones=norms, skip=("lm_head.weight",), rename=checkpoint_name
    )  # lm_head: tied
    (out / "config.json").write_text(json.dumps(TINY_VL_CONFIG, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))


def checkpoint_name(module_name: str) -> str:
    """The name a weight has in Qwen2.5-VL's released checkpoints, from its transformers (>= 5) module name:
    ``model.language_model.X`` is stored as ``model.X`` and ``model.visual.X`` as ``visual.X``.  SGLang's
    ``Qwen2_5_VLForConditionalGeneration.load_weights`` knows only the released names (it raised ``KeyError:
    'model.language_model.layers.0.mlp.gate_up_proj.weight'`` on the module names); transformers maps them
    back when it loads."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if module_name.startswith(new):
            return old + module_name[len(new) :]
    return module_name


def noise_png(width: int, height: int, seed: int) -> bytes:
    """A PNG of uniform RGB noise from a fixed seed: a test image whose every pixel differs between seeds
    (examples, tests and benchmarks of vision-language rollouts)."""
    import torch  # lazy: build
    from PIL import Image  # lazy: build

    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()
