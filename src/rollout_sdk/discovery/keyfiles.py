"""Job key files: where a torchrun job without a secret keeps the key that seals its store values.

Local rank 0 of such a job writes a fresh key to a 0600 file in a 0700 directory of this user's
(:func:`key_dir`); the file is named by the job's torchrun agent (every rank's parent): its pid, the
agent's start time (so a recycled pid is told apart), its run id and restart count::

    $XDG_RUNTIME_DIR or /tmp / rollout_sdk-<uid> / job-<agent pid>-<agent start>-<run id>-a<restart>.key

Why the name carries the agent (issue 36):

* a rank killed with SIGKILL runs no ``finally``: its key file stays.  :func:`remove_stale` removes every
  file whose agent is gone (no such pid, or a pid now of another process) or that an earlier attempt of a
  live agent left (a lower restart count); every job start and every client that looks for a key runs it;
* a client started outside the job (``ROLLOUT_SDK_STORE=host:port``, same user, same machine) with neither
  ``ROLLOUT_SDK_JOB_KEY_FILE`` nor a job secret finds the job's key among the live files
  (:func:`live_key_files`): the one whose seal verifies the job's first store value
  (``discovery/store.py``); with none, it refuses the job's records instead of trusting them unchecked.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ..errors import ConfigError

__all__ = [
    "key_dir",
    "key_dirs",
    "key_file_name",
    "live_key_files",
    "private_dir",
    "process_start_time",
    "remove_stale",
]

_PREFIX = "job-"
_SUFFIX = ".key"


def key_dir(env: Mapping[str, str] | None = None) -> Path:
    """This user's job key directory (``$XDG_RUNTIME_DIR`` when set, else the temp directory)."""
    env = os.environ if env is None else env
    return Path(env.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"rollout_sdk-{os.getuid()}"


def key_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Every place a job of this user may have written its key: a job started from another session may have
    had another ``XDG_RUNTIME_DIR``."""
    env = os.environ if env is None else env
    dirs = [key_dir(env), key_dir({"XDG_RUNTIME_DIR": f"/run/user/{os.getuid()}"}), key_dir({})]
    return list(dict.fromkeys(dirs))


def process_start_time(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot (``/proc``), "" where there is no
    ``/proc`` or no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    fields = raw[raw.rfind(b")") + 2 :].split()  # after "pid (comm) ": field 3 is fields[0]
    return fields[19].decode() if len(fields) > 19 else ""


def key_file_name(agent_pid: int, run_id: str, restart: str) -> str:
    run = "".join(c for c in run_id if c.isalnum() or c in "_")[:64] or "none"
    start = process_start_time(agent_pid) or "0"
    return f"{_PREFIX}{agent_pid}-{start}-{run}-a{restart}{_SUFFIX}"


def _parse(name: str) -> tuple[int, str, str, int] | None:
    """(agent pid, start time, run id, restart) of a key file's name; None when it is not one."""
    if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
        return None
    parts = name[len(_PREFIX) : -len(_SUFFIX)].split("-")
    if len(parts) != 4 or not parts[3].startswith("a"):
        return None
    pid, start, run, restart = parts
    if not (pid.isdigit() and start.isdigit() and restart[1:].isdigit()):
        return None
    return int(pid), start, run, int(restart[1:])


def _agent_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process now holds the pid: not our agent
    now = process_start_time(pid)
    return not now or start == "0" or now == start  # without /proc, the pid alone decides


def _is_stale(path: Path, names: list[str]) -> bool:
    parsed = _parse(path.name)
    if parsed is None:
        return False  # not a key file of ours: left alone
    pid, start, run, restart = parsed
    if not _agent_alive(pid, start):
        return True
    # a live agent restarted its workers: the key files of its earlier attempts are dead
    for other in names:
        p = _parse(other)
        if p is not None and p[:3] == (pid, start, run) and p[3] > restart:
            return True
    return False


def remove_stale(directory: Path) -> list[Path]:
    """Remove the key files in ``directory`` whose job is gone; return them."""
    try:
        files = [p for p in directory.iterdir() if p.name.startswith(_PREFIX)]
    except OSError:
        return []
    names = [p.name for p in files]
    removed = []
    for p in files:
        if _is_stale(p, names):
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
    return removed


def live_key_files(env: Mapping[str, str] | None = None) -> list[Path]:
    """The key files of this user's live jobs (stale ones removed on the way), newest first; only from a
    directory that is this user's alone (see :func:`private_dir`)."""
    found: list[Path] = []
    for d in key_dirs(env):
        try:
            st = d.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            continue
        remove_stale(d)
        with contextlib.suppress(OSError):
            found += [p for p in d.iterdir() if _parse(p.name) is not None]

    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    return sorted(found, key=mtime, reverse=True)


def private_dir(path: Path) -> None:
    """Make ``path`` (mode 0700), or accept it only when it is this user's and nobody else may enter it (a
    directory someone else made in a shared /tmp could hand the key over)."""
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(
            "job key directory", str(path), "must be a directory of this user's with mode 0700 (remove it)"
        )
