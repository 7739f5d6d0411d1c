"""A child process the SDK starts never outlives its parent (issue 36 item 10).

``die_with_parent()`` runs first in such a child (the server's decode worker is one): a daemon thread
waits on the parent's sentinel, the pipe ``multiprocessing`` keeps between a spawned child and its parent,
whose write end only the parent holds.  The kernel closes it whatever ends the parent (SIGKILL, a crash,
``os._exit``), so the thread wakes at once and the child leaves with ``os._exit``: no poll, no timeout,
nothing to clean up (the parent is gone).

Why not ``PR_SET_PDEATHSIG`` (Linux): it fires when the *thread* that started the child ends, not the
process, and the decode worker is started from a thread of the default executor (off the event loop), so
it could kill a healthy server's worker; and it exists only on Linux.  A parent that is only stopped
(SIGSTOP) keeps its children: it may be continued.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading

__all__ = ["die_with_parent"]


def die_with_parent() -> bool:
    """In a child started by ``multiprocessing`` (spawn or forkserver): leave as soon as the parent process is
    gone.  Returns False where there is no parent to watch (not a multiprocessing child)."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return False

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="rollout-sdk-lifeline", daemon=True).start()
    return True
