"""A statistical stack sampler for every Python process of a benchmark, SGLang's scheduler included.

    ROLLOUT_SDK_STACKS_DIR=/tmp/stacks python ...   # with bench/_boot on PYTHONPATH (see install())

Each process that imports this module with ``ROLLOUT_SDK_STACKS_DIR`` set starts one daemon thread that,
every ``ROLLOUT_SDK_STACKS_INTERVAL_S`` (default 0.02 s), reads ``sys._current_frames()`` and counts the
stack of every other thread (innermost 24 frames), and times every garbage collection with a
``gc.callbacks`` hook.  Counts are kept per *window*: the driver names the current window by writing its
label to ``<dir>/window`` (:func:`set_window`); when the label changes, each process writes what it counted
in the window that ended to ``<dir>/<label>.<pid>.json`` and starts again.  So a benchmark gets, for every
pass, where each thread of each process spent its time (a thread blocked in ``poll``/``recv``/``sleep``
shows as such: the innermost frame says whether it waited or worked).

Why not py-spy: it is not in the GPU image, and it needs ptrace rights a container may not give; this
needs nothing but the standard library.  Cost: one ``sys._current_frames()`` walk per interval (tens of
microseconds with the GIL held), so about 0.2% of a core at 50 Hz.

:func:`install` makes a directory holding a ``sitecustomize.py`` that imports this module; put it first on
``PYTHONPATH`` before starting the processes to sample (SGLang's spawned children inherit the
environment).  An existing ``sitecustomize`` further down the path is still imported.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from typing import Any

__all__ = ["collect", "install", "set_window", "start"]

_DEPTH = 24
_started = False


def _frame_key(frame: Any) -> str:
    parts = []
    f = frame
    while f is not None and len(parts) < _DEPTH:
        co = f.f_code
        parts.append(f"{os.path.basename(co.co_filename)}:{co.co_name}:{f.f_lineno}")
        f = f.f_back
    return ";".join(reversed(parts))


class _Sampler:
    def __init__(self, root: str, interval: float) -> None:
        self.root = root
        self.interval = interval
        self.window = ""
        self.window_mtime = 0.0
        self.counts: dict[str, dict[str, int]] = {}  # thread name -> stack -> samples
        self.samples = 0
        self.t0 = time.time()
        self.gc_s = [0.0, 0.0, 0.0]
        self.gc_n = [0, 0, 0]
        self._gc_start = 0.0
        self._lock = threading.Lock()
        self.me = 0  # the sampler thread's own id (set when it runs)

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            g = int(info.get("generation", 2))
            self.gc_s[g] += time.perf_counter() - self._gc_start
            self.gc_n[g] += 1

    def check_window(self) -> None:
        path = os.path.join(self.root, "window")
        try:
            m = os.stat(path).st_mtime
        except OSError:
            return
        if m == self.window_mtime:
            return
        self.window_mtime = m
        try:
            with open(path) as f:
                label = f.read().strip()
        except OSError:
            return
        if label != self.window:
            self.flush()
            self.window = label

    def flush(self) -> None:
        with self._lock:
            counts, self.counts = self.counts, {}
            samples, self.samples = self.samples, 0
            gc_s, gc_n = self.gc_s, self.gc_n
            self.gc_s, self.gc_n = [0.0, 0.0, 0.0], [0, 0, 0]
            t0, self.t0 = self.t0, time.time()
        if not self.window or not samples:
            return
        threads = {}
        for name, stacks in counts.items():
            top = sorted(stacks.items(), key=lambda kv: -kv[1])[:40]
            leaves: dict[str, int] = {}
            for stack, n in stacks.items():
                leaf = stack.rsplit(";", 1)[-1]
                leaves[leaf] = leaves.get(leaf, 0) + n
            threads[name] = {
                "samples": sum(stacks.values()),
                "top_stacks": [{"n": n, "stack": s} for s, n in top],
                "top_leaves": sorted(({"n": n, "leaf": k} for k, n in leaves.items()), key=lambda d: -d["n"])[:25],
            }
        out = {
            "pid": os.getpid(),
            "argv": " ".join(sys.argv)[:300],
            "proc": _proc_name(),
            "window": self.window,
            "seconds": round(time.time() - t0, 2),
            "interval_s": self.interval,
            "samples": samples,
            "gc_seconds": [round(x, 4) for x in gc_s],
            "gc_collections": gc_n,
            "radix_patch": getattr(sys.modules.get("rollout_sdk.engines.sglang.radix_patch"), "_applied", None),
            "threads": threads,
        }
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.window)[:80]
        try:
            with open(os.path.join(self.root, f"{safe}.{os.getpid()}.json"), "w") as f:
                json.dump(out, f)
        except OSError:
            pass

    def run(self) -> None:
        self.me = threading.get_ident()
        names: dict[int, str] = {}
        next_check = 0.0
        while True:
            time.sleep(self.interval)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.25
                self.check_window()
                names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
            frames = sys._current_frames()
            with self._lock:
                self.samples += 1
                for ident, frame in frames.items():
                    if ident == self.me:
                        continue
                    name = names.get(ident, str(ident))
                    key = _frame_key(frame)
                    d = self.counts.setdefault(name, {})
                    d[key] = d.get(key, 0) + 1
            del frames


def _proc_name() -> str:
    try:
        with open(f"/proc/{os.getpid()}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def start() -> None:
    """Start this process's sampler if ``ROLLOUT_SDK_STACKS_DIR`` is set (idempotent)."""
    global _started
    root = os.environ.get("ROLLOUT_SDK_STACKS_DIR")
    if _started or not root:
        return
    _started = True
    s = _Sampler(root, float(os.environ.get("ROLLOUT_SDK_STACKS_INTERVAL_S", "0.02")))
    gc.callbacks.append(s.on_gc)
    threading.Thread(target=s.run, name="stack-sampler", daemon=True).start()


def set_window(root: str, label: str) -> None:
    """Start a new window in every sampled process (each flushes the last one within ~0.25 s)."""
    tmp = os.path.join(root, "window.tmp")
    with open(tmp, "w") as f:
        f.write(label)
    os.replace(tmp, os.path.join(root, "window"))


def collect(root: str, label: str) -> list[dict[str, Any]]:
    """The windows named ``label`` that every process wrote (call after the next :func:`set_window`)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:80]
    out = []
    for name in sorted(os.listdir(root)):
        if name.startswith(safe + ".") and name.endswith(".json") and name.count(".") == 2:
            try:
                with open(os.path.join(root, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    return out


_BOOT = '''\
"""Made by bench/_stacks.py install(): start the stack sampler in every Python process."""
import importlib.util, os, sys
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_rollout_sdk_stacks", {path!r})
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
_mod.start()
# chain to a sitecustomize further down the path, if any
sys.modules.pop("sitecustomize", None)
_path = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
try:
    import sitecustomize  # noqa: F401
except ImportError:
    pass
finally:
    sys.path[:] = _path
'''


def install(root: str) -> str:
    """Make ``root`` (the windows) and ``root/boot`` (a ``sitecustomize.py`` that starts the sampler);
    return the boot directory, to put first on ``PYTHONPATH``."""
    boot = os.path.join(root, "boot")
    os.makedirs(boot, exist_ok=True)
    with open(os.path.join(boot, "sitecustomize.py"), "w") as f:
        f.write(_BOOT.format(path=os.path.abspath(__file__)))
    return boot
