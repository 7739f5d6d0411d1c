"""GRPO: prompts x samples, every sample of a prompt tagged with the prompt's group."""

from __future__ import annotations

from workloads.work import Draw, Item, Work


def sized(name: str, base: str, draw: Draw, *, quick: bool, salt: str) -> Work:
    """``grpoPxG`` (e.g. ``grpo2048x8``): 64 prompts of P tokens x G samples, GRPO's long-tailed output lengths;
    ``grpoPxGfN``: N output tokens each.  ``base`` is the name without a leading ``update``."""
    shape_part, _, fixed = base[4:].partition("f")
    p, g = (int(x) for x in shape_part.split("x"))
    prompts = 8 if quick else 64
    p = min(p, 512) if quick else p
    w = Work(name)
    for i in range(prompts):
        prompt = draw.ids(p)
        w.items += [
            Item(prompt, 32 if quick else (int(fixed) if fixed else draw.tail_len()), f"{salt}-g{i}") for _ in range(g)
        ]
    return w


def mixed(name: str, draw: Draw, *, quick: bool, big: bool, salt: str) -> Work:
    """``grpo``: 64 prompts (32 at 7B) of 128-512 tokens x 8, the long-tailed lengths (since issue 20)."""
    w = Work(name)
    for i in range(16 if quick else (64 if big else 32)):
        prompt = draw.ids(draw.size(128, 513))
        w.items += [Item(prompt, 32 if quick else draw.tail_len(), f"{salt}-g{i}") for _ in range(8)]
    return w
