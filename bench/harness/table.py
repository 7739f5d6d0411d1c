"""Tables as the benchmarks print them: aligned text for a terminal, Markdown for docs/benchmarks.md.

Cells are formatted by the caller (``f"{x:,.0f}"``); a table only lays them out.  In :func:`table` the
first column is left-aligned and the rest right-aligned, unless ``left`` names more columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence[object]], *, left: Iterable[int] = (0,), gap: int = 2) -> str:
    """Aligned text: a header line, a rule, one line a row; columns as wide as their widest cell."""
    body = [[str(c) for c in r] for r in rows]
    cols = [list(header), *body]
    widths = [max(len(r[i]) for r in cols if i < len(r)) for i in range(len(header))]
    lefts = set(left)

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            out.append(c.ljust(widths[i]) if i in lefts else c.rjust(widths[i]))
        return (" " * gap).join(out).rstrip()

    head = line(list(header))
    return "\n".join([head, "-" * len(head), *(line(r) for r in body)])


def markdown(header: Sequence[str], rows: Iterable[Sequence[object]], *, numeric: Iterable[int] = ()) -> str:
    """A Markdown table; columns in ``numeric`` are right-aligned (``---:``)."""
    nums = set(numeric)
    rule = ["---:" if i in nums else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def records(rows: Sequence[Mapping[str, object]], *, decimals: int = 2) -> str:
    """A Markdown table of result dicts: the first one's keys are the columns, floats get ``decimals``."""
    cols = list(rows[0]) if rows else []

    def cell(v: object) -> str:
        return f"{v:.{decimals}f}" if isinstance(v, float) else str(v)

    return markdown(cols, [[cell(r.get(c)) for c in cols] for r in rows])


def span_cell(d: Mapping[str, float] | None, fmt: str = "{:,.0f}") -> str:
    """A :func:`harness.stats.span` as a cell, ``median [min-max]`` in ``fmt``; ``-`` for none."""
    if not d:
        return "-"
    return f"{fmt.format(d['median'])} [{fmt.format(d['min'])}-{fmt.format(d['max'])}]"
