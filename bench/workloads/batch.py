"""Plain batches, every request on its own: long decodes and many short requests."""

from __future__ import annotations

from workloads.work import Draw, Item, Work


def long(name: str, draw: Draw, *, quick: bool, big: bool, salt: str = "") -> Work:
    """``long``: 1,024 x 512 prompt / 512 new tokens (0.5B); 256 x 512 / 1,024 at 7B."""
    n, o = (32, 64) if quick else ((1024, 512) if big else (256, 1024))
    return Work(name, items=[Item(draw.ids(64 if quick else 512), o) for _ in range(n)])


def short(name: str, draw: Draw, *, quick: bool, big: bool, salt: str = "") -> Work:
    """``short``: 8,192 (0.5B) or 4,096 (7B) x 64 prompt / 16 new tokens."""
    return Work(name, items=[Item(draw.ids(64), 16) for _ in range(256 if quick else (8192 if big else 4096))])
