"""The Dumpers of this process: the open ones (``_open_dumpers``), those whose close() is
running, closing them all at interpreter exit (``close_all``, before the staging engine
stops), and forgetting the parent's after ``os.fork()``.

A helper of the Dumper's modules (fastdump/capture/dumper.py); see docs/INTERNALS.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

from ..staging import engine as _engine

log = logging.getLogger("fastdump")


_open_dumpers: "weakref.WeakSet[Dumper]" = weakref.WeakSet()
# Dumpers whose close() is running (held: a thread still uses each); the exit hook waits for them
_closing_dumpers: "set[Dumper]" = set()


def close_all(deadline: float | None = None) -> None:
    """Close every open Dumper of this process (interpreter exit), all by ``deadline``
    (time.monotonic()) if given."""
    interrupted = None  # a Ctrl-C (or SystemExit) ends the close it lands in, not the others': raised after
    for dumper in list(_open_dumpers):
        if dumper._pid != os.getpid():
            continue  # a forked child never touches its parent's dumpers (see _forget_parent_dumpers)
        try:
            dumper.close() if deadline is None else dumper.close(max(0.0, deadline - time.monotonic()))
        except _engine.EXIT_INTERRUPTS as exc:
            interrupted = interrupted or exc
        except Exception as exc:
            log.error("fastdump: closing %s at exit failed: %s", dumper.dir, exc)
    # A close() running on another thread (a daemon thread; the exit hook runs as those still run)
    # was no open Dumper here: the engine shut down under it before its close message was in the
    # ring, and its dump, whole, failed verify ("writer process exited"). Its end is waited for.
    for dumper in list(_closing_dumpers):
        if dumper._pid == os.getpid():
            try:
                dumper._close_done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except _engine.EXIT_INTERRUPTS as exc:
                interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def _forget_parent_dumpers() -> None:
    """In a child made by os.fork(): the parent's Dumpers and engine are the parent's alone.

    The child shares the parent's ring mapping and writer pipes; a close or a staged tensor from it
    would land in the parent's dump (or shut it down). Its copies of the parent's Dumpers become
    pass-throughs; the child may attach Dumpers of its own, which start their own engine."""
    engines = {id(d._engine): d._engine for d in list(_open_dumpers) if d._engine is not None}
    for engine in engines.values():
        engine.forget_in_forked_child()
    me = threading.get_ident()
    for dumper in list(_open_dumpers):
        dumper._capturing = False
        if dumper._depth > 0:  # a pass another thread of the parent had open: that thread is not here,
            # so the pass never ends; this thread's calls of the model join it, not as a second thread
            # (which logged "forwards from several threads at once" in the child, naming the parent's dir)
            dumper._pass_thread = me
        dumper._counts_lock = threading.RLock()  # (another thread of the parent may have held it)
        dumper._lock = threading.Lock()  # (as may a registration: see _follow_registrations)
        dumper._let_go_of_the_ring(fold=False)  # the parent's counts are the parent's
        dumper.status = "not dumping in this process (forked child of the attaching process)"
    _open_dumpers.clear()
    _closing_dumpers.clear()  # (a parent thread's close: not in this process, never waited for here)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_dumpers)
_engine.on_exit(close_all)  # dumpers close before the engine stops, at interpreter exit
