"""The model cache: directories built once, atomically, under ``$ROLLOUT_SDK_HOME/models``.

Concurrency (several processes may ask for the same model at once: pytest workers, server subprocesses,
torchrun ranks)::

    process A                                   process B
    ensure(dest) -> dest missing                ensure(dest) -> dest missing
    flock(dest.lock)  <- holds it               flock(dest.lock)  <- waits (a build can take minutes)
    build into dest.XXXX (a temporary dir)
    chmod (0644 files / 0755 dirs, less umask)
    rename(dest.XXXX -> dest)                   (the rename is atomic: dest is whole or absent)
    unlock                                      -> acquires, sees dest complete, returns it

The lock only saves duplicate work (training the tool model takes minutes); correctness comes from the
rename: a process that cannot lock (a filesystem without ``flock``) still never sees a half-built model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["build_once", "default_home"]


def default_home() -> Path:
    return Path(os.environ.get("ROLLOUT_SDK_HOME") or Path.home() / ".cache" / "rollout_sdk")


def build_once(dest: Path, build: Callable[[Path], None], *, marker: str = "model.safetensors") -> Path:
    """Return ``dest``, first building it with ``build(tmp_dir)`` unless ``dest/marker`` exists."""
    if (dest / marker).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent / (dest.name + ".lock")):
        if (dest / marker).exists():  # built by another process while this one waited
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        try:
            build(tmp)
            _publishable(tmp)
            try:
                os.rename(tmp, dest)
            except OSError:
                if not (dest / marker).exists():  # not a lost race (no lock): a real failure
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl  # optional: fcntl
    except ImportError:  # pragma: no cover - not POSIX: the atomic rename alone keeps the cache whole
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # blocking: called from a worker thread or a CLI
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _publishable(root: Path) -> None:
    """One mode for the whole directory: what the umask allows of 0644 files and 0755 directories
    (``mkdtemp`` makes 0700 and some writers 0600; a cache shared by users of one machine needs neither)."""
    umask = _umask()
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755 & ~umask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644 & ~umask)


def _umask() -> int:
    """This process's umask, read without ``os.umask`` (setting it to read it races with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
