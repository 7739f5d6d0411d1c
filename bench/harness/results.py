"""Results as JSON, with the machine facts beside the numbers (docs/benchmarks.md cites these files)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def save_results(path: str | Path, rows: list[Any], args: dict[str, Any]) -> dict[str, Any]:
    """Write ``{"meta": ..., "rows": rows}`` as JSON to ``path`` (meta: date, machine and load, ``args``);
    return the meta."""
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "args": args,
    }
    write_json(path, {"meta": meta, "rows": rows}, indent=1)
    return meta


def write_json(path: str | Path, payload: Any, *, indent: int = 2) -> Path:
    """Write ``payload`` as JSON (parent folders made, a final newline, non-JSON values as ``str``); through a
    temporary file and a rename, so a benchmark killed mid-write leaves the last whole file."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=indent, default=str) + "\n")
    os.replace(tmp, out)
    return out


def publish(path: str | Path, payload: dict[str, Any], text: str) -> None:
    """Write ``payload`` (its ``meta`` holds ``runtime_s``) as JSON to ``path``, print ``text`` (the table),
    then the runtime and where the numbers are: the last lines a benchmark prints."""
    write_json(path, payload)
    print(text)
    print(f"\nruntime {payload['meta']['runtime_s']} s; numbers in {path}")
