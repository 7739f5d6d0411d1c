"""Images in a request: decoding them safely and expanding their marks into the model's image tokens.

A prompt marks each image as Qwen2.5-VL does, ``<|vision_start|><|image_pad|><|vision_end|>``, in the order
of ``GenerateRequest.images``.  The SDK (not the engine's own processor) expands every mark into the number of
``<|image_pad|>`` tokens the image takes::

    bytes --Pillow (bounded decode)--> RGB image --Qwen2VLImageProcessor--> pixel_values, grid_thw (t, h, w)
    image tokens = t * h * w / merge_size**2

so the ids, spans and grid sizes every engine sees are the ones the result reports and a trainer re-uses.
A mark whose pad run already has the image's full length is kept as it is (a multi-turn request resends the
expanded ids of earlier turns with all their images); any other run length is an error.

Everything here is blocking CPU work (decode, resize, normalise): engines call it off the event loop.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from ..errors import InvalidRequestError

__all__ = [
    "IMAGE_MARK",
    "IMAGE_PAD_ID",
    "MAX_IMAGE_PIXELS",
    "VISION_END_ID",
    "VISION_START_ID",
    "ImageProcessor",
    "VisionInputs",
    "cached_image_processor",
    "decode_image",
    "load_image_processor",
]

VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_ID = 151655
#: the text of one image mark in a prompt (Qwen2.5-VL's chat template writes it for every image part)
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
#: the decompression-bomb bound: an image file that decodes to more pixels than this is refused before
#: its pixels are decoded (Pillow reads the size from the header); the processor then resizes it down
MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class VisionInputs:
    """A request's images, processed: what the engine feeds the model and what the result reports.

    ``input_ids``: the prompt with every mark expanded; ``spans[i] = (start, length)`` of image ``i``'s pad
    tokens in it; ``grid_thw[i]``: its (t, h, w) patch grid; ``pixel_values``: the processor's flattened
    patches of all images, in order (a float32 torch tensor ``[sum(t*h*w), C*tp*p*p]``).
    """

    input_ids: list[int]
    spans: list[tuple[int, int]]
    grid_thw: list[tuple[int, int, int]]
    pixel_values: Any

    @property
    def num_image_tokens(self) -> int:
        return sum(n for _, n in self.spans)

    def result_fields(self) -> dict[str, Any]:
        """The GenerateResult fields that report this expansion."""
        return {
            "input_ids": list(self.input_ids),
            "image_spans": list(self.spans),
            "image_grid_thw": list(self.grid_thw),
        }


def decode_image(data: bytes, field: str, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """``data`` (an encoded image file) as an RGB ``PIL.Image``; :class:`InvalidRequestError` naming ``field``
    when it is not an image Pillow can read, or has more than ``max_pixels`` pixels (checked from the header,
    before the pixels are decoded)."""
    value = f"<{len(data)} bytes>"
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            too_big = w < 1 or h < 1 or w * h > max_pixels
            if not too_big:
                out = img.convert("RGB")  # an animation: its first frame
                out.load()
    except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(field, value, f"not a readable image: {exc}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated or corrupt data
        raise InvalidRequestError(field, value, f"image cannot be decoded: {type(exc).__name__}: {exc}") from None
    if too_big:
        raise InvalidRequestError(field, value, f"image is {w}x{h}: more than {max_pixels} pixels")
    return out


class ImageProcessor:
    """A model's image processor (transformers' ``Qwen2VLImageProcessor``) and its token geometry."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.merge_size = int(processor.merge_size)

    def tokens_for(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size**2)

    def process(self, images: list[bytes], field: str = "images") -> tuple[Any, list[tuple[int, int, int]]]:
        """Decode and process ``images``: ``(pixel_values, grid_thw per image)``."""
        if not images:
            return None, []
        pixels, grids = [], []
        for i, data in enumerate(images):  # one decoded image alive at a time (each up to MAX_IMAGE_PIXELS)
            img = decode_image(data, f"{field}[{i}]")
            try:
                out = self.processor(images=[img], return_tensors="pt")
            except Exception as exc:  # a shape the processor refuses (e.g. a 1x4000 strip)
                size = f"{img.width}x{img.height}"
                raise InvalidRequestError(f"{field}[{i}]", size, f"cannot process: {exc}") from None
            pixels.append(out["pixel_values"].to(torch.float32))
            grids.append(tuple(int(v) for v in out["image_grid_thw"][0].tolist()))
        return torch.cat(pixels, dim=0), grids  # type: ignore[return-value]

    def model_inputs(self, ids: list[int], images: list[bytes], spans: list[tuple[int, int]]) -> dict[str, Any]:
        """What a trainer feeds transformers' ``Qwen2_5_VLForConditionalGeneration`` for ``ids`` (a result's
        ``input_ids`` + ``output_ids``, or a trajectory's ``ids``) with its ``images`` and ``image_spans``:
        ``input_ids`` [1, L], ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (1 on the
        image spans), the very pixels and grids the engine used.  The model computes the M-RoPE positions
        from these (``get_rope_index``)."""
        pixels, grids = self.process(images)
        if len(spans) != len(grids) or any(n != self.tokens_for(g) for (_, n), g in zip(spans, grids, strict=False)):
            raise ValueError(f"spans {spans} do not fit the images' grids {grids}")
        input_ids = torch.tensor([ids], dtype=torch.long)
        types = torch.zeros_like(input_ids, dtype=torch.int)
        for start, n in spans:
            types[0, start : start + n] = 1
        return {
            "input_ids": input_ids,
            "pixel_values": pixels,
            "image_grid_thw": torch.tensor(grids, dtype=torch.long),
            "mm_token_type_ids": types,
        }

    def expand(self, input_ids: list[int], images: list[bytes]) -> VisionInputs:
        """Process ``images`` and expand their marks in ``input_ids`` (see the module docstring)."""
        marks = find_marks(input_ids)
        if len(marks) != len(images):
            raise InvalidRequestError(
                "images",
                f"<{len(images)} images>",
                f"the prompt marks {len(marks)} image(s) (<|vision_start|><|image_pad|><|vision_end|>): "
                "one image per mark, in order",
            )
        pixels, grids = self.process(images)
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for i, ((start, length), grid) in enumerate(zip(marks, grids, strict=True)):
            n = self.tokens_for(grid)
            if length not in (1, n):
                raise InvalidRequestError(
                    f"images[{i}]",
                    f"<grid {grid}>",
                    f"its mark holds {length} <|image_pad|> tokens: must be 1 (expanded here) or {n} (expanded)",
                )
            out.extend(input_ids[pos:start])
            spans.append((len(out), n))
            out.extend([IMAGE_PAD_ID] * n)
            pos = start + length
        out.extend(input_ids[pos:])
        return VisionInputs(input_ids=out, spans=spans, grid_thw=grids, pixel_values=pixels)


def find_marks(input_ids: list[int]) -> list[tuple[int, int]]:
    """``(start, length)`` of every ``<|image_pad|>`` run of ``input_ids`` (each is one image's mark).

    A run must sit between ``<|vision_start|>`` and ``<|vision_end|>``; a pad token anywhere else is an error.
    """
    marks: list[tuple[int, int]] = []
    i, n = 0, len(input_ids)
    while i < n:
        if input_ids[i] != IMAGE_PAD_ID:
            i += 1
            continue
        j = i
        while j < n and input_ids[j] == IMAGE_PAD_ID:
            j += 1
        if i == 0 or input_ids[i - 1] != VISION_START_ID or j == n or input_ids[j] != VISION_END_ID:
            raise InvalidRequestError(
                f"input_ids[{i}]", IMAGE_PAD_ID, "an <|image_pad|> outside <|vision_start|> ... <|vision_end|>"
            )
        marks.append((i, j - i))
        i = j
    return marks


@functools.lru_cache(maxsize=8)
def cached_image_processor(model_path: str) -> ImageProcessor | None:
    """:func:`load_image_processor`, once per model directory (blocking on first use)."""
    return load_image_processor(model_path)


def load_image_processor(model_path: str | Path) -> ImageProcessor | None:
    """The image processor of the model at ``model_path``, or None for a text-only model (no
    ``preprocessor_config.json``).

    Always transformers' Pillow backend (``Qwen2VLImageProcessorPil``), never the torchvision one that
    ``AutoImageProcessor`` picks where torchvision is installed: their resizing may differ in the last bits,
    and the rollout machine and the trainer's must produce the very same pixels."""
    cfg_path = Path(model_path, "preprocessor_config.json")
    if not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text())
    if "Qwen2VL" not in str(cfg.get("image_processor_type", "")):
        return None
    from transformers import Qwen2VLImageProcessorPil  # optional: transformers-vision

    return ImageProcessor(Qwen2VLImageProcessorPil.from_pretrained(str(model_path)))
