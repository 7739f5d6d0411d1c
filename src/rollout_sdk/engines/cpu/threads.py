"""The CPU engine's intra-op threads: how many its worker uses, and keeping that choice the worker's own.

Why one thread for a small model.  Torch splits each op over its intra-op (OpenMP) threads, one per core by
default, and every split op ends at a barrier that waits for all of them.  A step of the embedded tiny
model (hidden size 64, 2 layers) is hundreds of ops of a few microseconds each: splitting them saves
nothing, and on a machine where anything else runs (a trainer, a test suite, another engine) one of the
threads is often descheduled, so each barrier waits for a scheduler tick.  Measured on the 2-core VM
(issue 37, docs/first-hour.md): at a load of ~5.5 the README example's ``generate_many`` (32 requests x 16
tokens) took 3.2-13.3 s at torch's default two threads against 1.6-3.2 s at one, the first request after
start 2-3 s against 0.3 s, and ``bench/cpu_batching.py`` at c=1 17-24 tok/s against 171-189 tok/s at a
load of ~3.  A larger model's ops are long enough to be worth splitting: it keeps torch's default.

Why it stays the worker's.  ``torch.set_num_threads`` sets the calling thread's OpenMP team size, and also
the process-wide number that every thread which has not yet run a parallel op adopts on its first one.  The
embedded engine shares the user's process (a trainer's backward pass on the main thread, its worker
threads): :func:`use_threads` sets the worker's own size and then puts the process-wide number back.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

__all__ = ["SMALL_HIDDEN_SIZE", "threads_for", "use_threads"]

#: a model whose hidden size is below this runs on one intra-op thread unless num_threads says otherwise
#: (measured at 64, the tiny models; 0.5B-class models, 896 and up, keep torch's default)
SMALL_HIDDEN_SIZE = 512


def threads_for(model_dir: str | Path, configured: int | None) -> int | None:
    """The worker's intra-op threads: ``configured`` when given, 1 for a small model, else None (torch's
    default).  A config that cannot be read counts as not small (the load that follows says why)."""
    if configured:
        return configured
    try:
        cfg = json.loads(Path(model_dir, "config.json").read_text())
        text = cfg.get("text_config") or cfg
        hidden = int(text.get("hidden_size") or cfg.get("hidden_size"))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return 1 if hidden < SMALL_HIDDEN_SIZE else None


def use_threads(n: int) -> None:
    """Run this thread's torch ops on ``n`` intra-op threads, leaving the process-wide default as it was.

    Order matters: this thread first adopts the process-wide number (its first ``get_num_threads``), so
    it never re-reads it later; then its own size is set; then a short-lived thread puts the process-wide
    number back (setting it from here would reset this thread's size too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    if before != n:
        restore = threading.Thread(target=torch.set_num_threads, args=(before,), name="torch-threads-restore")
        restore.start()
        restore.join()
