"""Tool-call parsers: time per turn, and scaling on adversarial text (linear vs quadratic).

What is measured
----------------
For each built-in format (``rollout_sdk.agents.get_parser``), the best of ``--repeat`` wall times of
``parser.parse(text)`` on:

* ``turn``: a typical assistant turn, 400 characters of prose and two well-formed calls;
* ``calls x N``: ``N`` well-formed calls one after the other;
* ``opens x N``: ``N`` blocks that open and never close, then one close at the end (the shape that made the
  first Hermes parser rescan the rest of the text for every block).

``--baseline FILE`` also times another single-file ``parsers.py`` (e.g. the last one before the package
split: ``git show ce0da4a:src/rollout_sdk/agents/parsers.py > /tmp/old_parsers.py``) on the Hermes inputs.  Times
are for this machine only; the ratio between sizes is what shows linear (x4 size, ~x4 time) against
quadratic (~x16).  The tests check linearity by counted work, not by these times.

Usage::

    python bench/parsers.py [--sizes 2000 8000 32000] [--repeat 3] [--baseline /tmp/old_parsers.py]
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from typing import Any

import harness

from rollout_sdk.agents import get_parser


def call_text(fmt: str, i: int) -> str:
    args = {"path": f"notes/{i}.txt", "content": "line one\nline two <b>bold</b>"}
    if fmt == "hermes":
        return f"<tool_call>\n{json.dumps({'name': 'write_file', 'arguments': args})}\n</tool_call>\n"
    if fmt == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function=write_file>\n{params}</function>\n</tool_call>\n"
    if fmt == "llama3_json":
        return ("<|python_tag|>" if i == 0 else "; ") + json.dumps({"name": "write_file", "parameters": args})
    return f"[TOOL_CALLS]write_file[ARGS]{json.dumps(args)}"


OPEN = {
    "hermes": ('<tool_call>"x"', "</tool_call>"),
    "qwen3_coder": ("<tool_call><function=f><parameter=a>x", "</parameter>"),
    "llama3_json": ('<|python_tag|>{"name": "', '"}'),
    "mistral": ("[TOOL_CALLS][ARGS]", ""),
}


def inputs(fmt: str, sizes: list[int]) -> list[tuple[str, str]]:
    prose = ("The user wants two files written; I will write them now. " * 7)[:400]
    turn = (
        call_text(fmt, 0) + call_text(fmt, 1) if fmt == "llama3_json" else prose + call_text(fmt, 0) + call_text(fmt, 1)
    )
    out = [("turn", turn)]
    out += [(f"calls x {n}", "".join(call_text(fmt, i) for i in range(n))) for n in sizes]
    unit, tail = OPEN[fmt]
    out += [(f"opens x {n}", unit * n + tail) for n in sizes]
    return out


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 32000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", help="another single-file parsers.py to time on the Hermes inputs")
    args = ap.parse_args()
    rows: list[tuple[str, str, int, float]] = []
    for fmt in ("hermes", "qwen3_coder", "llama3_json", "mistral"):
        parser = get_parser(fmt)
        for name, text in inputs(fmt, args.sizes):
            rows.append((fmt, name, len(text), best_of(lambda p=parser, t=text: p.parse(t), args.repeat)))
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_parsers", args.baseline)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        old = module.HermesParser()
        for name, text in inputs("hermes", args.sizes):
            rows.append(("hermes (baseline)", name, len(text), best_of(lambda t=text: old.parse(t), args.repeat)))
    out = []
    for fmt, name, chars, seconds in rows:
        shown = f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"
        out.append([fmt, name, chars, shown, f"{chars / seconds / 1e6:.1f}"])
    print(harness.table(["parser", "input", "chars", "time", "MB/s"], out, left=(0, 1)))


if __name__ == "__main__":
    main()
