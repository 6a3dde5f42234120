"""Capture: which modules are dumped, what their tensors are called, where passes begin and end.

Each selected module gets an instance-level ``forward`` wrapper instead of a forward hook: the
wrapper runs whether the model calls ``module(x)`` or ``module.forward(x)`` (engine models do the
latter, and hook-based dumpers then silently write nothing). The wrapper hands each tensor to the
staging engine, which copies it (CPU) or snapshots it on the producer stream (CUDA) before
returning, so later in-place kernels cannot change what is dumped.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import inspect
import logging
import numbers
import os
import signal
import socket
import sys
import threading
import time
import types
import weakref
from pathlib import Path

from .. import _C
from .. import dtypes as _dtypes
from .. import protocol
from ..options import Options, check_meta_keys as _check_meta_keys, check_runtime_env as _check_runtime_env
from ..options import warn_unknown_env_once
from .lazy import STAND_INS as _LAZY_STAND_INS
from .manifest import cuda_index as _cuda_index, device_facts as _device_facts, write_manifest as _write_manifest
from .manifest import write_role_marker as _write_role_marker, write_session_marker as _write_session_marker
from .ranks import resolve_ranks  # noqa: F401 - part of this module's face
from .selection import named_modules, original as _original_module, root_selected as _root_selected, select_modules
from .selection import select_subtree as _select_subtree, SHARED_LEFT_OUT_REASON as _SHARED_LEFT_OUT
from .selection import SHADOWED_REASON as _SHADOWED_REASON, forward_shadowed as _forward_shadowed, \
    is_script_module as _is_script_module, shared_left_out as _shared_left_out, \
    unwrappable_modules as _unwrappable_modules
from ..staging import engine as _engine
from ..staging import channel as _channel_mod
from ..staging import graphs as _graphs
from ..staging.engine import Engine
from ..fsutil import DirAnchor, atomic_write_json as write_json_atomic, load_json as _load_json
from .. import format as _fmt
from .. import segment_list as _segment_list

log = logging.getLogger("fastdump")

_open_dumpers: "weakref.WeakSet[Dumper]" = weakref.WeakSet()
# Dumpers whose close() is running (held: a thread still uses each); the exit hook waits for them
_closing_dumpers: "set[Dumper]" = set()
_MIXED_REASON = "forwards of several threads ran at once in this pass (mixed tensors)"
_MAX_LATE_ENDS = 4096  # refused pass ends kept to send again (each a small dict)
_MAX_SUSPENDED_FOR = 256  # entries of a pass's suspended_for kept (the rest counted)


def close_all(deadline: float | None = None) -> None:
    """Close every open Dumper of this process (interpreter exit), all by ``deadline``
    (time.monotonic()) if given."""
    for dumper in list(_open_dumpers):
        if dumper._pid != os.getpid():
            continue  # a forked child never touches its parent's dumpers (see _forget_parent_dumpers)
        try:
            dumper.close() if deadline is None else dumper.close(max(0.0, deadline - time.monotonic()))
        except Exception as exc:
            log.error("fastdump: closing %s at exit failed: %s", dumper.dir, exc)
    # A close() running on another thread (a daemon thread; the exit hook runs as those still run)
    # was no open Dumper here: the engine shut down under it before its close message was in the
    # ring, and its dump, whole, failed verify ("writer process exited"). Its end is waited for.
    for dumper in list(_closing_dumpers):
        if dumper._pid == os.getpid():
            dumper._close_done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


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


# ------------------------------------------------------------------------------------------------
# Twins (ranks: capture/ranks.py; selection: capture/selection.py; manifest: capture/manifest.py)


_DIR_TRIES = 8  # fresh session ids drawn before a Dumper gives up on its own directory


def _check_not_inside_a_dump(root: Path) -> None:
    """A root that is a rank or role directory of a dump (a path copied from `fastdump ls`) would put
    a second dump inside the first: files in evidence that no writer of it made. Refused."""
    names = _listing(root)
    if (root / _fmt.RANK_FILE).exists() or any(_fmt.SEGMENT_RE.match(n) for n in names):
        raise ValueError(f"{root} is a rank directory of a dump (it holds {_fmt.RANK_FILE} or segments): "
                         "give the dump's root, or a new directory")
    if _fmt.parse_rank_dir(root.parent.name) is not None and (root.parent / _fmt.RANK_FILE).exists():
        raise ValueError(f"{root} is inside a rank directory of a dump: give the dump's root, or a new directory")
    if any(_fmt.parse_rank_dir(n) is not None and (root / n / _fmt.RANK_FILE).exists() for n in names):
        raise ValueError(f"{root} is a role directory of a dump (<root>/<role>, it holds rank directories): "
                         "give the dump's root, or a new directory")


def _listing(directory: Path) -> list:
    try:
        return os.listdir(directory)
    except OSError:
        return []  # (missing: made next; unreadable: mkdir says why)


def _warn_if_twin(dumper, model=None) -> None:
    """Two live Dumpers of one process on the same root, role and ranks (a draft attached without
    ``role=``, say) write separate session directories; say so, since it is rarely intended. One
    model attached twice (a second attach without close()) is named as such: "give each model its
    own role=" was the wrong advice there, and under two roles each Dumper dumps every call."""
    original = _original_module(model) if model is not None else None
    for other in list(_open_dumpers):
        if other is not dumper and not other._closed and original is not None and other._model_ref() is original:
            log.warning("fastdump: this model is already attached (role %r, %s); both Dumpers dump every call "
                        "of it. close() that Dumper before attaching again", other.role, other.dir)
            return
        if other is not dumper and other.root == dumper.root and other.role == dumper.role \
                and other.ranks == dumper.ranks and not other._closed:
            log.warning("fastdump: another Dumper of this process already dumps role %r, ranks %s to %s; "
                        "this one writes its own directory %s (give each model its own role=)",
                        dumper.role, _fmt.rank_dir_name(dumper.ranks, dumper._pid), other.dir, dumper.dir)
            return


# ------------------------------------------------------------------------------------------------
# The Dumper


class Dumper:
    """Dumps one role/rank of one model: one session, one rank directory. Made by
    :func:`fastdump.attach`; a context manager whose exit is ``close()``.

    Passes: each root forward is one (``root_passes=True``), or ``begin_pass()``/``end_pass()``
    and ``with manual_pass(**meta)``; ``set_pass_meta(**meta)`` adds facts to the current pass.
    ``dump(name, value)`` stores a value no module returns, ``watch(module, name)`` captures one
    more module. ``stats()`` counts what was dumped, dropped and skipped; ``not_wrapped`` names the
    modules fastdump could not wrap, with the reason. Nothing here raises into the model's forward:
    what cannot be stored is a recorded skip, a failure of dumping is logged and recorded and the
    model serves on.
    """

    def __init__(self, model, options: Options, *, ranks: dict):
        """``options``: checked already (``Options.__post_init__``); ``ranks``: from resolve_ranks."""
        _check_runtime_env()  # FASTDUMP_CUDA_* & co. are read later, by C++ among others: checked here, first
        warn_unknown_env_once()  # a misspelt FASTDUMP_* name, also when attach() is called directly
        if model is not None and _is_script_module(_original_module(model)):
            # Refused before anything is created: no directory, no writer. (Its submodules run as
            # TorchScript, so only its output could be dumped; a Python parent gives that.)
            raise ValueError(f"fastdump.attach: the model is a torch.jit ScriptModule ({type(model).__name__}), "
                             "whose forward fastdump cannot wrap: attach the model before scripting or "
                             "tracing it, or a Python module that calls it (its output is then dumped)")
        if model is not None and options.root_name is not None:
            _check_root_name(model, options.root_name)  # before anything is created, as above
        o = self.options = options
        root, role = o.root, o.role
        self.role = role
        self.ranks = ranks
        self.root = Path(root).absolute()
        self.session = _fmt.new_session_id()  # its own directory, even when the pid repeats
        self.dir = self.root / role / _fmt.rank_dir_name(ranks, os.getpid(), self.session)
        self._own_dir = False  # self.dir made by this Dumper (_make_own_dir): only then written to
        self._anchor = None  # self.dir held open (fsutil.DirAnchor): what this process writes or reads there
        self.policy = o.policy
        self.inputs = bool(o.inputs)
        self.skip_passes, self.every = int(o.skip_passes), int(o.every)
        self.pass_range = tuple(int(p) for p in o.pass_range) if o.pass_range is not None else None
        self.max_bytes = o.max_bytes
        self.device_ring_mb = o.device_ring_mb
        self.pass_id = -1
        self._standalone_passes = 0  # passes of dump() calls outside any pass: selection does not count them
        self.status = "running"
        self.error = None
        self._unconfirmed = collections.deque()  # seqs of pass ends the writer has not handled yet
        # Pass ends a full ring refused, oldest first: sent again, marked late (_send_late_ends).
        # A list: the C root_pass reads it, and takes its fast begin only while it is empty.
        self._late_ends: list = []
        self._late_lock = threading.Lock()
        self._pid = os.getpid()
        self._calls: dict = {}           # name -> calls started this pass, for name#k (_claim)
        self._open_calls: list = []      # (name, k, pass_id) of calls the outside() wrappers opened
        self._name_ids: dict = {}
        # What the C++ forward wrappers share: the _capturing flag, _calls, _name_ids, the C++ lane.
        self._state = _C.CaptureState(self, self._calls, self._name_ids, _TensorType)
        self._state.dynamo = _DYNAMO  # under torch.compile its Python calls stay outside the graph
        self._state.liveness_s = _engine.LIVENESS_POLL_S  # (its root_pass checks the writer as _begin does)
        self._capturing = False          # inside a selected pass: the wrappers' only hot check
        self._depth = 0                  # nested begin_pass / root calls
        self._meta: dict = {}
        self._next_meta: dict = dict(o.pass_meta or {})
        self._skipped: dict = {}         # name -> reason, this pass
        # Call name -> the container structure of its output, this pass, for outputs whose stored
        # names do not tell it (_structure_of); _structure_at: of those that stored nothing, the
        # tensors staged before they returned (a position, made relative at the pass's end).
        self._structure: dict = {}
        self._structure_at: dict = {}
        self._incomplete = None          # why this pass is not whole (a forward raised, ...), or None
        self._mixed = False              # forwards of several threads ran in this pass
        self._pass_thread = None         # thread that opened the pass
        self._manual_opener = None       # (frame, instruction) of the begin_pass() that opened it
        self._root_opener = None         # the root wrapper's frame whose forward opened the pass
        self._said: set = set()          # warnings already logged once
        self._names_lock = threading.Lock()
        self._budget_reached = False
        self._folded_drops = (0, 0)  # the channel's drop counts already in _totals
        self._totals = {"passes": 0, "tensors": 0, "bytes": 0, "dropped": 0, "skipped": 0, "dropped_passes": 0,
                        "lost_pass_ends": 0, "late_pass_ends": 0, "interrupted_pass_ends": 0,
                        "incomplete_passes": 0, "mixed_passes": 0, "lost_at_close": 0, "graphs_not_dumped": 0,
                        "compiled_not_dumped": 0, "modules_not_followed": []}
        self._wrapped: list = []  # (module, our wrapper), in wrapping order; what each wraps: _wrapped_by
        self._module_names: set = set()  # the names wrapped modules dump under (a container's parts must not take one)
        self._flat_names: set = set()    # names given to containers' parts in pass _flat_pass (see _name_taken)
        self._flat_pass = None
        self._indexed_parents: set = set()
        self._manual_depth = 0           # begin_pass() calls not yet ended in the open pass
        # Per root forward running outside any pass of this Dumper that suspended other Dumpers'
        # passes (root_passes=False, _outside_pass_wrapper): those Dumpers.
        self._forwards_outside_passes: list = []
        # Lazy results (capture/lazy.py) dropped unconsumed while a pass of this Dumper was open:
        # closed once it has ended (_close_dropped_lazy), so their cleanup is not taken for its calls.
        self._dropped_lazy: list = []
        self._close_done = threading.Event()  # set when a close() has finished (close_all waits for it)
        self._closing_thread = None  # the thread whose close() runs (or ran)
        # close() ended a pass its root forward opened, still running, that suspended other Dumpers'
        # passes: they capture again when that forward returns (_cut_outer_passes).
        self._resume_at_root_return = False
        self._model_ref = lambda: None  # weakref to the model's (uncompiled) root, set by _install
        self._holds_models: dict = {}    # model weakref -> whether it is part of this Dumper's model
        self._python_wrappers = False  # set for good once torch.compile traces the model
        self._tokens: list = []  # this Dumper's entries in _GRAPH_TOKENS
        self._strict_graph_names: set = set()  # modules traced into graphs that may not break
        # CUDA-graph record mode (fastdump/staging/graphs.py); None: tensors hooked during a capture are skipped.
        self._graphs = _graphs.GraphRecording(self, o.graph_ring_mb) if o.cuda_graphs == "record" else None
        self._engine = None
        self._channel = None  # staging/channel.py: the ring, the block policy, the stagers, drops
        self._stage_fast = None  # the channel's C++ hot path (ChannelStager.stage_tensor)
        self._closed = False
        self._lock = threading.Lock()
        # _fold_lane_counts and _staged_so_far (reentrant: a signal handler's stats() may come in
        # on the thread that holds it)
        self._counts_lock = threading.RLock()

        config = o.manifest_config()
        # Modules fastdump cannot wrap (TorchScript; a forward property; a name that reads as a
        # call's): {name: reason}, logged and kept in rank.json's config. (A model that cannot even
        # be walked fails in _install, which records why.)
        try:
            self.not_wrapped = _unwrappable_modules(model, self._root_name_of(model)) if model is not None else {}
        except Exception:
            self.not_wrapped = {}
        # And shared modules the selection asks for under a name they are not wrapped under (not
        # TorchScript: _install's `scripted` leaves these out).
        try:
            self._shared_left_out = _shared_left_out(model, layers=o.layers, include=o.include, exclude=o.exclude,
                                                     module_types=o.module_types) if model is not None else {}
        except Exception:
            self._shared_left_out = {}
        self.not_wrapped.update(self._shared_left_out)
        try:
            _check_not_inside_a_dump(self.root)
            self._make_own_dir()
            _write_role_marker(self.root, role)  # (after the rank directory: a recorded role has one)
            _write_session_marker(self.root, role, self.dir.name)  # (and a recorded session has its own)
            _write_manifest(self.root, config)
            self._engine = Engine.acquire(o.engine)
            self._producer = self._engine.producer
            facts = _device_facts(model)
            # `block` waits for ring space up to block_timeout_s; after a timeout the channel stages
            # as under `drop` until the writer gives ring space back (Channel.begin / note_stall).
            self._channel = self._engine.open_channel(
                dict(dir=str(self.dir), role=role, rank=ranks, pid=self._pid, session=self.session,
                     host=socket.gethostname(), device=facts,
                     config=dict(config, not_wrapped=self.not_wrapped) if self.not_wrapped else config),
                fast_codes=_FAST_CODES, strided=_strided, block=o.policy == "block",
                block_timeout_s=o.block_timeout_s, device_ring_mb=o.device_ring_mb)
            if not self._engine.alive:
                raise RuntimeError(self._engine.error())
            if self._channel.failed:  # (its directory could not be opened: the writer's log says why)
                raise RuntimeError(self._channel_failure())
            # The CPU hot path: channel, pass id and wait settings live in C++, set once per pass.
            self._stage_fast = self._channel.stage_fast
            if type(self._channel.lane) is _C.ChannelStager:  # (tests' CUDA-mock engines bring their own)
                self._state.lane = self._channel.lane  # the C++ forward wrappers' stage_tensor
            index = _cuda_index(o.device, facts)
            if index is not None:
                self._channel.prepare_cuda(index)
            if self._graphs is not None:
                self._graphs.prepare(_cuda_index(o.device, facts))
        except Exception as exc:
            if _raised_in_a_signal_handler(exc):  # the caller's (a deadline's alarm): theirs to see, as Ctrl-C
                self._abandon_attach(f"attach interrupted ({type(exc).__name__})", writer_stuck=True)
                raise
            if o.strict:
                self._abandon_attach(None)
                raise
            self._abandon_attach(f"cannot start dumping to {self.dir}: {exc}")
            return
        except BaseException as exc:  # Ctrl-C (KeyboardInterrupt) during attach: recorded, then raised
            self._abandon_attach(f"attach interrupted ({type(exc).__name__})", writer_stuck=True)
            raise
        _warn_if_twin(self, model)
        _open_dumpers.add(self)
        if model is not None:
            self._root_name = self._root_name_of(model)
            try:
                self._install(model, o.root_passes, layers=o.layers, include=o.include, exclude=o.exclude,
                              module_types=o.module_types)
            except Exception as exc:  # a model whose modules cannot be walked or wrapped
                self._disable(f"cannot wrap the model's modules: {type(exc).__name__}: {_short(exc)}")
                self.close()  # unwraps what was wrapped, stops this Dumper's writer channel
                if o.strict:
                    raise
            if self.not_wrapped and self.status == "running":
                log.warning("fastdump: %s: not wrapped: %s", self.dir,
                            "; ".join(f"{name}: {why}" for name, why in self.not_wrapped.items()))

    def _make_own_dir(self) -> None:
        """Create this session's rank directory, which no one else may write: a directory that
        already exists (two processes of one pid, as containers have, starting in one microsecond
        with the same random bits; a test's fixed session id) belongs to another Dumper, whose
        segments and rank.json this one's writer would overwrite. A fresh session id is drawn."""
        for _ in range(_DIR_TRIES):
            try:
                self.dir.parent.mkdir(parents=True, exist_ok=True)
            except FileExistsError as exc:  # (said only "File exists" of a root that is a dangling link)
                what = "a symbolic link to nothing" if os.path.islink(exc.filename or "") else "not a directory"
                raise FileExistsError(f"{exc.filename} is {what}") from None
            try:
                self.dir.mkdir()
                self._anchor = DirAnchor(str(self.dir))  # the directory made, wherever it is moved
                self._own_dir = True
                return
            except FileExistsError:
                self.session = _fmt.new_session_id()
                self.dir = self.dir.parent / _fmt.rank_dir_name(self.ranks, self._pid, self.session)
        raise FileExistsError(f"{_DIR_TRIES} session directories in {self.dir.parent} existed already")

    def _root_name_of(self, model) -> str:
        return self.options.root_name or type(_original_module(model)).__name__

    @property
    def _capturing(self) -> bool:
        """Inside a selected pass. The flag lives in the C++ CaptureState: the forward wrappers'
        only check outside a pass reads it there."""
        return self._state.capturing

    @_capturing.setter
    def _capturing(self, value: bool) -> None:
        self._state.capturing = value

    @property
    def _in_selected_pass(self) -> bool:
        """Inside a selected pass, capturing or suspended: another Dumper's pass (an EAGLE draft run
        inside the target's forward) is open inside it on its thread, and its wrappers pass through
        until that one ends. A value given to ``dump()`` meanwhile is still this pass's."""
        state = self._state
        return state.capturing or state.suspended

    # -- public API ------------------------------------------------------------------------------
    def begin_pass(self, **meta) -> None:
        """Start a pass by hand (nests: only the outermost begin/end pair counts).

        The pass lasts until the matching ``end_pass()``, across any number of root forwards, as
        long as the function that called ``begin_pass()`` is running. Once that function has
        returned without ``end_pass()``, or when the same ``begin_pass()`` call runs again, the pass
        is dangling: it is closed (recorded incomplete, logged) at the next root forward or
        ``begin_pass()``, which start a pass of their own."""
        _check_meta_keys("begin_pass", meta)
        self._begin_manual(meta, sys._getframe(1))

    def _begin_manual(self, meta: dict, caller) -> None:
        """begin_pass() called from ``caller`` (the frame whose return leaves the pass dangling)."""
        opener = self._manual_opener
        if opener is not None and opener[0] is caller and opener[1] == caller.f_lasti:
            self._close_dangling("begin_pass() ran again before end_pass()")
        (self._meta if self._depth > 0 else self._next_meta).update(meta)  # nested: the open pass's
        opening = self._depth == 0
        self._begin()
        self._manual_depth += 1
        if opening:
            self._manual_opener = (caller, caller.f_lasti)

    def end_pass(self, incomplete: str | None = None) -> bool:
        """End the pass the matching ``begin_pass()`` began. Without one open it does nothing
        (logged once): it must not end a pass a root forward opened, whose later tensors would be
        lost while the pass read as whole. ``incomplete``: why the pass is not a whole forward (a
        call in it raised): it is stored ``complete = False`` with that reason (the first reason
        given for a pass is the one kept), as a root forward that raised. Called from another
        thread than the one that began the pass, it ends it marked mixed (that thread's later calls
        would be in no pass while the pass read as whole). Returns whether it ended a
        ``begin_pass()`` (False: none was open)."""
        if self._manual_depth == 0:
            self._say_once("end_pass", "fastdump: %s: end_pass() without an open begin_pass(): ignored", self.dir)
            return False
        if incomplete is not None and self._depth > 0:
            self._mark_incomplete(str(incomplete)[:200])
        if self._in_selected_pass:
            self._check_thread()  # the opening thread may be inside the pass still: its later calls go to none
        self._manual_depth -= 1
        self._end()
        if self._dropped_lazy:
            self._close_dropped_lazy()
        return True

    def manual_pass(self, **meta) -> "_ManualPass":
        """``with dumper.manual_pass(**meta):`` one pass around the block: ``begin_pass(**meta)``
        before it, ``end_pass()`` after it; an exception leaving the block ends the pass incomplete
        with the exception as the reason (as a root forward that raised) and propagates."""
        _check_meta_keys("manual_pass", meta)
        return _ManualPass(self, meta)

    def set_pass_meta(self, **meta) -> None:
        """Small JSON-able facts about the current pass (or the next one, outside a pass). The keys
        ``DumpSet.meta`` adds of its own (complete, dropped, skipped, tensors, bytes, incomplete,
        mixed, and nested passes' nested_in, suspended_for, suspended_for_left_out) are refused
        (ValueError): a reader could not tell the two apart. Called from another thread than the
        open pass's (an overlap scheduler's, for its next batch), it marks that pass mixed, as
        ``dump()`` does: which pass the facts describe cannot be told."""
        _check_meta_keys("set_pass_meta", meta)
        if self._in_selected_pass:
            self._check_thread()  # another thread's pass is open: these facts would be that pass's
        (self._meta if self._depth > 0 else self._next_meta).update(meta)

    def dump(self, name: str, value) -> None:
        """Dump a value no module returns (tensors, CuPy/DLPack arrays, tuples/lists/dicts/dataclasses
        of them) under ``name`` into the current pass; outside any pass, into a pass of its own
        (always dumped, not counted by ``every``/``skip_passes``/``pass_range``). A name given
        again in one pass is numbered as a repeated call (``name#1``). Never raises: a name that
        is no string or holds ``#<digits>``, and what cannot be stored, are recorded skips."""
        if self._in_selected_pass:
            self._check_thread()  # another thread's pass is open: this value would join it
            self._capture(name, value, given=True)
        elif self._depth == 0 and not self._closed and self._engine is not None:
            # Outside any pass: a pass of its own, always dumped (every/skip_passes/pass_range do
            # not apply to it, nor count it), so the value is never silently lost.
            self._begin(standalone=True)
            try:
                if self._capturing:
                    self._capture(name, value, given=True)
            finally:
                self._end()

    def watch(self, module, name: str, *, convert=None, before=None) -> None:
        """Capture ``module``'s calls under ``name`` as well: any module (a decoder layer, a whole
        sub-model), with hooks for calls whose output or arguments need a word of explanation.

        ``convert(output)`` returns what to dump of an output (a tensor, a container of them, None
        for nothing); the module still returns its output unchanged. The result is named like any
        output: ``name``, ``name.0`` ..., ``name#k`` for the k-th call in a pass. ``before(args,
        kwargs)`` runs inside the pass before each call's forward (it may call ``set_pass_meta``);
        what it returns, a dict or None, is dumped as ``name.<key>`` (``name#k.<key>``): values the
        call was given. Both run only in a selected pass; one that raises or returns something
        unusable is recorded as a skip of that call, never raised into the model. ``inputs=True``
        applies as to every wrapped module. ``close()`` unwraps it. Call it before serving, once
        per module, for a module this Dumper does not wrap already (leave it out of the selection
        with ``exclude=``). Raises ValueError for a name that is empty or holds ``#<digits>`` and
        for a module this Dumper wraps already, TypeError for a module without a forward to wrap
        or a hook that is not callable, RuntimeError once the Dumper is closed."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"watch: name must be a non-empty string, not {name!r}")
        if _fmt.reads_as_call(name):
            raise ValueError(f"watch: {name!r}: a name holding '#<digits>' reads as a repeated call's (name#k)")
        if not callable(getattr(module, "forward", None)):
            raise TypeError(f"watch: {type(module).__name__} has no forward to wrap")
        if _forward_shadowed(module):
            raise TypeError(f"watch: {type(module).__name__}'s forward is a property: a wrapper would never run")
        for hook, what in ((convert, "convert"), (before, "before")):
            if hook is not None and not callable(hook):
                raise TypeError(f"watch: {what} must be callable or None, not {type(hook).__name__}")
        if self._closed:
            raise RuntimeError(f"watch: the Dumper of {self.dir} is closed")
        if any(wrapped is module for wrapped, _ in self._wrapped):
            raise ValueError(f"watch: {name!r}: this Dumper wraps that module already (leave it out of "
                             "the selection with exclude=, and watch each module once)")
        self._module_names.add(name)
        self._wrap(module, self._hooked_wrapper(name, module.forward, convert, before, _owner_of(module)))

    @property
    def in_pass(self) -> bool:
        """True between a pass's begin and end (root forward or begin_pass)."""
        return self._depth > 0

    def stats(self) -> dict:
        """Counts so far (``passes``, ``tensors``, ``bytes``, ``dropped``, ``skipped``,
        ``mixed_passes``, ...), ``status`` ("running", "closed", "error", ...), ``error`` (why
        dumping stopped, or None) and ``dir``, the rank directory."""
        self._fold_lane_counts()
        return dict(self._totals, status=self.status, error=self.error, dir=str(self.dir))

    def close(self, timeout: float = 600.0) -> dict:
        """Flush everything staged, wait until it is on disk, detach from the model.

        Returns within about ``timeout`` seconds whatever the writer does: what was not confirmed
        on disk by then is recorded as an error in the stats and producer_error.json. Ctrl-C interrupts it
        (KeyboardInterrupt, after recording the error). Returns ``stats()``; a second call does
        nothing more. TypeError for a ``timeout`` that is no number (None, NaN), before anything."""
        # Checked before anything is done: a timeout of None or "5" raised TypeError after the
        # wrappers came off, with the Dumper marked closed and its channel open (a second close()
        # did nothing, status "running" for good); NaN waited for nothing and lost every buffered pass.
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout != timeout:
            raise TypeError(f"close: timeout must be a number of seconds, not {timeout!r}")
        with self._lock:  # (held by a registration wrapping a module put in: see _follow_registrations)
            closing = self._closing_thread
            if self._closed and closing not in (None, threading.get_ident()) and self._pid == os.getpid():
                pass  # another thread's close() is running: waited for below
            elif self._closed:
                return self.stats()
            else:
                closing = None
                self._closed, self._closing_thread = True, threading.get_ident()
        if closing is not None:
            # It returned at once, status "running", rank.json not final: a caller reading or
            # verifying the dump next found it unfinished. Now it returns once that close has.
            self._close_done.wait(timeout)
            return self.stats()
        try:
            with self._lock:
                try:
                    self._totals["modules_not_followed"] = self._not_followed()
                except Exception as exc:  # (a model that cannot be walked now: said, not raised)
                    self._totals["modules_not_followed"] = [f"(the model's modules could not be checked at close: "
                                                            f"{type(exc).__name__}: {_short(exc)})"]
                if self._totals["modules_not_followed"]:
                    log.error("fastdump: %s: module edits after attach that fastdump could not follow "
                              "(`fastdump verify` fails): %s", self.dir,
                              "; ".join(self._totals["modules_not_followed"]))
            self._unwrap()
            _closing_dumpers.add(self)  # (the exit hook waits for it: see close_all)
            _open_dumpers.discard(self)
            return self._close_channel(timeout)
        finally:
            _closing_dumpers.discard(self)
            self._close_done.set()

    def _close_channel(self, timeout: float) -> dict:
        """close() once the wrappers are off: end what is open, flush, close the channel, let go."""
        if self._dropped_lazy:  # (dropped in a pass close() cuts short: unwrapped now, nothing captured)
            self._close_dropped_lazy()
        if self._engine is None or self._pid != os.getpid():
            self._let_go_of_the_dir()
            return self.stats()  # never started, or a forked child's copy: the parent's engine is not ours
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        try:
            if self._depth > 0:
                self._mark_incomplete("still open at close(): closed inside the model's forward"
                                      if self._root_opener is not None else
                                      "still open at close(): end_pass() was not called")
                self._cut_outer_passes()
                self._depth = 1
                self._end()
            if self._graphs is not None:  # replays' passes and counts, before the final flush; stops its drains
                self._graphs.close(self._totals, left())
            if self._engine.alive and self.status == "running":
                self._engine.flush_cuda(left())
                self._fold_lane_counts()
                # Records a capture holds are padding now (never written). They were staged, so they
                # are lost, not dropped by policy: rank.json says so and `fastdump verify` fails.
                held = self._engine.close_cuda_if_last(left())
                stuck = self._engine.cuda_close_stuck
                if held > 0:
                    self._totals["lost_at_close"] += held
                    log.error("fastdump: %d staged CUDA tensors lost at close: %s", held, stuck or
                              "a CUDA-graph capture still running on another stream held their batch")
                if stuck:  # the writer waits for good at the first unfinished record: nothing after it lands
                    self._disable(f"close timed out after {timeout:g} s: {stuck}; "
                                  f"{self._unconfirmed_passes()} passes not confirmed on disk", writer_stuck=True)
                stopped = None if stuck else self._engine.cuda_staging_stopped()
                if stopped:
                    # The drain failed after this Dumper's last CUDA tensor (a later one would have
                    # seen DISABLED), or in the final flush: what it had not copied became padding.
                    # rank.json says why; `verify` counts what is missing.
                    log.error("fastdump: %s: %s", self.dir, stopped)
                    self._channel.control(protocol.note(self._channel.id, "running",
                                                        cuda_staging={"stopped": stopped}), block=True)
                if self._late_ends:  # the writer got going again: their passes' ends, before the close
                    self._send_late_ends(deadline)
                ok = self._channel.control(protocol.close(self._channel.id, self._totals), wait=True,
                                           timeout=left())
                if self.status != "running":
                    pass  # given up on above (the CUDA stager never finished): said why already
                elif ok and self._channel.failed:  # this root's final segment write failed (disk full)
                    self._disable(self._channel_failure())
                elif ok and self._engine.alive:  # the final segment write itself can fail (disk full)
                    self.status = "closed"
                elif self._engine.closed:
                    self._closed_under_us()
                elif self._engine.alive:
                    self._disable(f"close timed out after {timeout:g} s; {self._unconfirmed_passes()} "
                                  "passes not confirmed on disk", writer_stuck=True)
                else:
                    self._disable(self._engine.error())
            elif self.status == "running" and self._engine.closed:
                self._closed_under_us()
            elif self.status == "running":
                self._disable(self._engine.error())
        except KeyboardInterrupt:
            self._disable(f"close interrupted (KeyboardInterrupt); {self._unconfirmed_passes()} passes "
                          "not confirmed on disk", writer_stuck=True)
            raise
        self._release_engine(left())
        self._let_go_of_the_ring()
        self._let_go_of_the_dir()
        return self.stats()

    def _closed_under_us(self) -> None:
        """The engine was shut down while this close() ran (the exit hook, past its deadline for
        this close on another thread): the writer closed this channel itself with what it had
        (rank.json "closed", an unfinished pass incomplete), without this close's message. Whole
        when every pass this Dumper ended is in the segment files; else those passes are lost and
        the error says why (not "writer process exited with code 0", which read as a crash)."""
        missing = self._totals["passes"] - self._passes_on_disk()
        if missing <= 0 and not self._late_ends:
            self.status = "closed"
            log.warning("fastdump: %s: the staging engine shut down (interpreter exit) while close() ran on "
                        "another thread; every pass is on disk, this close's counts are not in rank.json",
                        self.dir)
            return
        self._disable(f"the staging engine shut down (interpreter exit) while close() ran on another thread: "
                      f"{max(missing, len(self._late_ends))} passes not confirmed on disk", writer_stuck=True)

    def _let_go_of_the_dir(self) -> None:
        """Close the held rank directory: nothing is written there by this process any more."""
        if self._anchor is not None:
            self._anchor.close()

    def _let_go_of_the_ring(self, fold: bool = True) -> None:
        """Drop this Dumper's references to the ring (its 256 MiB mapping is freed with the last
        one). A Dumper sits in reference cycles (its wrappers, its capture state), so without this
        a closed Dumper kept its ring mapped and resident until the garbage collector happened to
        run: each attach/close cycle of a serving process added the ring's size to its RSS."""
        if fold:
            self._fold_lane_counts()  # the last counts, while the channel is still here
        self._engine = self._producer = self._channel = self._stage_fast = None
        self._state.lane = None

    def _unconfirmed_passes(self) -> int:
        """Passes this Dumper ended that are not known to be on disk (a close that timed out or was
        interrupted says how many). The writer acks a pass end once it has buffered it, long before
        its segment is written (256 passes, segment_seconds, idle or close): acks say nothing of the
        disk. What is: the segment list (segments.jsonl, committed by rank.json), which the writer
        extends after each segment file (see _passes_on_disk). Read here, at close only, never per pass."""
        acked = self._producer.acked_seq if self._producer is not None else 0
        not_handled = sum(1 for seq in self._unconfirmed if seq > acked)  # not even buffered
        return max(not_handled, self._totals["passes"] - self._passes_on_disk())

    def _passes_on_disk(self) -> int:
        """Ended passes in the segment files the segment list names (0 when it cannot be read). A pass a
        segment holds unfinished (``complete`` false: it was split) counts once, with its end."""
        try:
            info = _load_json(self._anchor.join(_fmt.RANK_FILE))
            segments, problem, _ = _segment_list.read(self._anchor.join(""), info)  # (its own writer's: this format)
            if problem:
                raise ValueError(problem)
            on_disk, open_pass = 0, None  # the previous segment's unfinished last pass
            for segment in segments:
                on_disk += int(segment["passes"])
                if open_pass is not None and int(segment["first_pass"]) == open_pass:
                    on_disk -= 1  # the same pass again, continued
                open_pass = None if segment.get("complete", True) else int(segment["last_pass"])
            return on_disk - (open_pass is not None)  # the last one's end is not on disk
        except Exception as exc:  # missing, unreadable, malformed: nothing is known to be on disk
            log.debug("fastdump: %s: cannot read %s: %s", self.dir, _fmt.RANK_FILE, exc)
            return 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- passes ----------------------------------------------------------------------------------
    def _begin(self, standalone: bool = False) -> None:
        # Threads: from the count to the opener's marks below there is no call, hence no point
        # where another thread can run (with the GIL): a second thread that enters the pass sees
        # the opener's thread and its mark of mixing sticks (a get_ident() or a reset after the
        # count let it see the previous pass's thread, or erased its mark).
        me = threading.get_ident()
        self._depth += 1
        opening = False  # the channel was asked to open the pass: its begin may be in the ring
        try:
            if self._depth > 1:
                if self._pass_thread != me and not self._mixed:
                    self._mixed = True  # before any call: no thread switch between the check and the mark
                    self._mark_mixed()
                return
            self._pass_thread = me
            self._incomplete, self._mixed = None, False
            self.pass_id += 1
            if standalone:
                self._standalone_passes += 1
            self._meta, self._next_meta = self._next_meta, {}
            # A pass of another Dumper open on this thread (this one runs inside its forward): its
            # wrappers pass through until this pass ends, so the modules both wrap (EAGLE's shared
            # embedding and LM head) are this pass's alone. (C: nothing to do when none is open.)
            # After the marks above: the call is a point where another thread may run and mark
            # this pass mixed, a mark the reset above would have erased.
            outer = self._state.suspend_others()
            if not outer and self._forwards_outside_passes:  # (begun inside such a forward: suspended by it,
                # those still suspended)
                outer = [d for d in self._forwards_outside_passes[-1] if self._state.holds(d._state)]
            if outer:  # where it ran, and in the outer pass what ran inside it: a reader can put the
                # roles' passes in order
                self._meta["nested_in"] = [{"role": d.role, "pass": d.pass_id} for d in outer]
                for other in outer:
                    other._note_suspended_for(self.role, self.pass_id)
            self._calls.clear()
            if self._open_calls:
                self._open_calls.clear()  # (calls that raised: never closed)
            if self._skipped:
                self._skipped = {}
            if self._structure:
                self._structure, self._structure_at = {}, {}
            # (A forked child's copies have no engine: _forget_parent_dumpers, at fork.)
            if self._closed or self._engine is None or self.status != "running":
                return
            # Selection applies to eager passes; a graph captured in a pass left out is recorded
            # all the same, since each of its replays is a pass of its own.
            if not self._selected(self.pass_id, standalone) and (
                    self._graphs is None or not self._graphs.capture_running()):
                return
            if not self._engine.alive_lately:  # a dead writer stops dumping, not serving
                return self._disable(self._engine.error())
            if self._channel.failed:  # this root's disk failed: this Dumper stops, not the others
                return self._disable(self._channel_failure())
            opening = True
            if not self._channel.begin(self.pass_id):
                return  # `drop` with a full ring: the whole pass is dropped (the channel counts it)
            self._capturing = True
            if self._late_ends:  # the ring took a record again: the refused ends may go now
                self._send_late_ends()
        except BaseException as exc:
            self._begin_interrupted(exc, opening)
            raise

    def _begin_interrupted(self, exc: BaseException, opening: bool) -> None:
        """Ctrl-C (KeyboardInterrupt, raised wherever a signal is delivered: a wait for ring space,
        a call's return) or any other exception stopped _begin after it counted the depth. The
        caller never gets to its _end, so undo the count here: a pass left open would swallow every
        later forward, dumping nothing more while verify said OK. A pass this call was opening is
        ended at once, marked incomplete (its begin may be in the ring already)."""
        if self._depth > 1:
            self._depth -= 1  # a nested begin: the open pass goes on
            return
        self._mark_incomplete(f"interrupted as it began: {type(exc).__name__}")
        if opening:
            self._capturing = True  # so that _end sends the pass's end, whether its begin went in or not
        self._end()

    def _end(self) -> None:
        if self._depth == 0:
            if self._resume_at_root_return and self._pass_thread == threading.get_ident():
                self._resume_at_root_return = False  # the root forward close() cut short returned
                self._state.resume_held()
            return
        self._depth -= 1
        if self._depth > 0:
            return
        if self._state.suspended:
            self._end_nested_first()
        # What this pass is, read before any call: at a call another thread may run and open the
        # next pass (new id, meta, skips, drop count), and this end must still be this pass's.
        state = self._state
        capturing = state.capturing or state.suspended  # (suspended: its end is still to be sent)
        state.capturing = False
        if not (self._forwards_outside_passes or self._resume_at_root_return):  # (else: when that forward returns)
            state.resume_held()  # the passes this one nested in capture again
        pass_id, meta, skipped, incomplete, mixed = (self.pass_id, self._meta, self._skipped, self._incomplete,
                                                     self._mixed)
        structure, structure_at = self._structure, self._structure_at
        self._manual_opener = self._root_opener = None  # (frames: let them go with the pass)
        self._manual_depth = 0
        if not capturing:
            return
        if mixed and incomplete is None:
            incomplete = _MIXED_REASON  # (marked mixed, the reason not set yet: a thread switch between)
        channel = self._channel
        dropped = channel.pass_dropped
        self._totals["passes"] += 1
        sent = False  # the pass's end is in the ring (or known lost)
        try:
            if self.max_bytes is not None:  # the budget needs the bytes now; stats() and close() fold anyway
                self._fold_lane_counts()
            if structure_at:
                structure = _placed(structure, structure_at, self._staged_so_far())
            try:
                meta = _jsonable(meta) if meta else {}  # (most passes carry none)
            except Exception as exc:  # a user's object whose str() raises: the pass is kept, its meta said so
                meta = {"fastdump_meta_error": f"{type(exc).__name__}: {_short(exc)}"}
            if self._graphs is not None and self._graphs.open is not None:
                # A graph was captured in this pass: its replays are passes (with this pass's structure record).
                self._graphs.end_pass(meta, incomplete, structure)
                if incomplete is None:  # (it marks this pass, the capture's, as holding no values)
                    incomplete = self._incomplete
            if incomplete is not None:
                self._totals["incomplete_passes"] += 1  # the writer records the pass as not complete
                if mixed:
                    self._totals["mixed_passes"] += 1  # `fastdump verify` fails on it
            seq = channel.end(pass_id, meta, skipped, incomplete, mixed, dropped, structure)
            sent = True
            if seq:
                self._unconfirmed.append(seq)
                if len(self._unconfirmed) > 64:
                    self._trim_unconfirmed()
                return
            if not self._engine.alive:
                self._disable(self._engine.error())
            else:  # the ring is full (`drop`, or `block` past block_timeout_s): the end goes later
                self._totals["lost_pass_ends"] += 1
                if len(self._late_ends) < _MAX_LATE_ENDS:  # (beyond: lost; the writer marks the pass incomplete)
                    self._late_ends.append(protocol.end(channel.id, pass_id, meta, dropped, skipped,
                                                        incomplete=incomplete, mixed=mixed, late=True,
                                                        structure=structure))
                channel.note_stall("a pass end", pass_id)
        except BaseException as exc:
            if not sent:
                self._end_interrupted(exc, incomplete)
            raise

    def _end_nested_first(self) -> None:
        """This pass ends while a pass of another Dumper opened inside it is still open (a draft's
        begin_pass() in the target's forward without its end_pass()): what ran since that one
        opened went to it, not here (this pass's own output included), so this pass is incomplete;
        and that one is dangling: closed now, marked so, or every later pass of this Dumper would
        suspend it and take the other role's calls as its own. (Suspended by another model's forward
        outside any pass of its Dumper (_outside_pass_wrapper) instead: nothing of this pass went
        elsewhere, and that forward resumes nothing once this pass has ended.)"""
        holder = next((other for other in list(_open_dumpers)
                       if other is not self and other._state.holds(self._state)), None)
        if holder is not None and holder._depth == 0 and holder._forwards_outside_passes:
            return
        self._mark_incomplete("a pass of another Dumper opened inside this one was still open when it "
                              "ended: what ran after that one opened is not in this pass")
        if holder is not None:
            holder._close_dangling(f"it was still open when the pass of role {self.role!r} it was "
                                   "opened inside ended", manual=holder._manual_depth > 0)

    def _cut_outer_passes(self) -> None:
        """close() ends this Dumper's pass while it is nested in passes of other Dumpers, perhaps
        with the forward in it still running (closed inside it, or from another thread). Resumed
        now, they would take that forward's later calls of the modules both wrap (the shared
        embedding and LM head) as ``lm_head#1``, ..., which read as their own model's. A pass a root
        forward opened: they stay suspended until that forward returns (its wrapper's _end resumes
        them), as they do for a root forward outside passes (_outside_pass_wrapper). A begin_pass()
        pass: where its forward ends is not known, so they are resumed now and marked mixed
        (verify fails)."""
        if self._forwards_outside_passes:
            return
        outer = [other for other in list(_open_dumpers) if other is not self and self._state.holds(other._state)]
        if not outer:
            return
        if self._root_opener is not None and self._manual_depth == 0:
            self._resume_at_root_return = True
            return
        for other in outer:
            other._mixed = True  # (before the reason, as _check_thread does)
            other._mark_incomplete(f"a pass of role {self.role!r} nested in it was ended by close() before "
                                   "its end_pass(): what ran after (that role's calls of the modules both wrap "
                                   "too) went into this pass (mixed tensors)")

    def _send_late_ends(self, deadline: float | None = None) -> None:
        """Send the pass ends a full ring refused, oldest first, until one is refused again (it
        waits for the next pass that opens, or close). ``deadline``: wait for space until then
        (close); None: never wait.

        Each carries what only the end says: the pass's drop count, metadata and skips; without it
        the pass stays `complete = 0`, its drops counted in no pass. The writer completes a pass it
        still buffers, or continues the one it flushed unfinished last (docs/INTERNALS.md, "Lost
        pass ends"). Never sent twice: one thread at a time, and a sent end is removed before the
        next is tried."""
        if not self._late_lock.acquire(blocking=False):
            return  # another thread is sending them
        try:
            late, engine = self._late_ends, self._engine
            while late and engine is not None:
                if deadline is None:  # (at a pass's begin: never a wait)
                    sent = engine.control(late[0], block=False)
                else:
                    sent = engine.control(late[0], block_timeout=max(0.0, deadline - time.monotonic()))
                if not sent:
                    return
                del late[0]
                self._totals["lost_pass_ends"] -= 1
                self._totals["late_pass_ends"] += 1
        finally:
            self._late_lock.release()

    def _trim_unconfirmed(self) -> None:
        """Forget the pass ends the writer has handled (checked now and then, not at every pass)."""
        unconfirmed, acked = self._unconfirmed, self._producer.acked_seq
        while unconfirmed and unconfirmed[0] <= acked:
            unconfirmed.popleft()

    def _end_interrupted(self, exc: BaseException, incomplete) -> None:
        """Ctrl-C (or another exception) stopped _end before it knew the pass's end was in the ring
        (a wait for ring space returns to Python so that Ctrl-C gets through; a C call's return is
        a point where a signal's exception is raised, too). Sending it again could put a second end
        behind one already written: a lost pass end, as under `drop` with a full ring, which the
        writer records as not complete when its segment is written."""
        if incomplete is None:
            self._totals["incomplete_passes"] += 1
        self._totals["interrupted_pass_ends"] += 1

    def _fold_lane_counts(self) -> None:
        """Tensors and bytes the C++ hot path staged (ChannelStager.stage_tensor) into _totals,
        and the drops the channel counted since the last fold."""
        channel = self._channel
        if channel is not None:
            with self._counts_lock:
                tensors, nbytes = channel.take_counts()
                totals = self._totals
                totals["tensors"] += tensors
                totals["bytes"] += nbytes
                totals["dropped"] += channel.dropped - self._folded_drops[0]
                totals["dropped_passes"] += channel.dropped_passes - self._folded_drops[1]
                self._folded_drops = (channel.dropped, channel.dropped_passes)

    def _selected(self, pass_id: int, standalone: bool = False) -> bool:
        """Whether pass ``pass_id`` is dumped. every/skip_passes/pass_range pick root forwards and
        manual passes, counted without the passes of dump() calls outside any pass: those are
        always dumped (the caller asked for that value), and they move no other pass in or out."""
        if not standalone:
            counted = pass_id - self._standalone_passes
            if counted < self.skip_passes or (counted - self.skip_passes) % self.every:
                return False
            if self.pass_range is not None and not self.pass_range[0] <= counted < self.pass_range[1]:
                return False
        if self.max_bytes is not None and self._totals["bytes"] >= self.max_bytes:
            if not self._budget_reached:
                self._budget_reached = True  # said once, not every pass
                log.warning("fastdump: %s reached its byte budget (%d bytes); dumping stops", self.dir, self.max_bytes)
                self._channel.control(protocol.note(self._channel.id, "running", budget_reached=True))
            return False
        return True

    def _mark_incomplete(self, reason: str) -> None:
        """The open pass is not a whole forward; the first reason is the one recorded."""
        if self._incomplete is None:
            self._incomplete = reason

    def _check_thread(self) -> None:
        """Inside the open pass: a calling thread other than the one that opened it marks it mixed."""
        if self._pass_thread != threading.get_ident() and not self._mixed:
            self._mixed = True  # (set before the call, as _begin does)
            self._mark_mixed()

    def _mark_mixed(self) -> None:
        """A second thread entered the open pass: its tensors and the first thread's are merged.
        The caller sets ``_mixed`` first, without a call in between (see _begin)."""
        self._mixed = True
        self._mark_incomplete(_MIXED_REASON)
        self._say_once("threads", "fastdump: %s: forwards from several threads at once on one Dumper: their "
                                  "passes are merged, marked incomplete (mixed) and fail `fastdump verify`; "
                                  "run one forward at a time per Dumper", self.dir)

    def _forward_raised(self, exc: BaseException) -> None:
        if self._depth > 0:
            self._mark_incomplete(f"a forward raised {type(exc).__name__}: {_short(exc)}")

    def _root_begin(self) -> None:
        """A root forward starts: close a dangling manual pass first (see begin_pass), or a pass
        an earlier root forward of this thread opened and never ended (a signal's exception,
        Ctrl-C, delivered on its way to _end: a Python call's first instruction is such a point)."""
        caller = sys._getframe(1)
        if caller.f_code is _CALL_CODE:
            caller = caller.f_back
        if caller is not None and caller.f_code is not _ROOT_CODE:
            caller = None  # (compiled: Dynamo's frames; no check)
        if self._depth > 0 and self._pass_thread == threading.get_ident():
            opener = self._manual_opener
            if opener is not None and not _on_stack(opener[0], caller or sys._getframe(1)):
                self._close_dangling("the function that called begin_pass() returned without end_pass()")
            elif (opener is None and self._root_opener is not None and caller is not None and not self._mixed
                  and not _on_stack(self._root_opener, caller)):  # (mixed: the count left is another thread's)
                self._close_dangling("the root forward that opened it returned without ending it "
                                     "(interrupted)", manual=False)
        if self._depth == 0:
            self._root_opener = caller  # before _begin: no moment where the pass is open unrecorded
        self._begin()

    def _close_dangling(self, why: str, manual: bool = True) -> None:
        self._mark_incomplete(f"dangling {'manual ' if manual else ''}pass: {why}; closed at the next pass")
        self._say_once("dangling", "fastdump: %s: %s; the open pass %d is closed, marked incomplete",
                       self.dir, why, self.pass_id)
        self._depth = 1
        self._end()

    def _say_once(self, key: str, fmt: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(fmt, *args)

    # -- capture (hot path) ------------------------------------------------------------------------
    def _claim(self, name: str) -> int:
        """The number (``#k``) of a call of ``name`` that starts now in this pass. Calls are numbered
        in the order they start, so that a call's inputs, its hooks' values and its output share one
        number even when the module calls itself (an inner call starts later and returns first)."""
        self._check_thread()  # as the C wrapper's claim_call: see there
        k = self._calls.get(name, 0)
        self._calls[name] = k + 1
        return k

    def _capture(self, name: str, value, convert=None, k=None, given=False) -> None:
        """``value`` returned by the call numbered ``k`` (None: a call, or a dump(), numbered now).
        ``given``: a value of dump(), whose name is the caller's and may read as another's."""
        if not (self._capturing or given and self._state.suspended):
            return
        if given and not (isinstance(name, str) and name):
            return self._skip(f"<dump() name {_short_repr(name)}>", "a name must be a non-empty string")
        call_name = _call_name(name, self._claim(name) if k is None else k)
        if given:
            taken = self._given_name_taken(name, call_name)
            if taken:
                return self._skip(call_name, taken)
        if convert is not None:  # a watched module's hook (watch)
            try:
                value = convert(value)
            except Exception as exc:
                return self._hook_failed(call_name, "convert(output)", exc)
        if not isinstance(value, _Tensor) and value is not None:
            self._note_structure(call_name, value)
        self._emit_safely(call_name, value)

    def _note_structure(self, call_name: str, value) -> None:
        """Record the container structure of an output whose stored names would not tell it (a
        dict with digit keys reads as a tuple; a tuple of Nones stores nothing). A plain tensor or
        tuple/list of tensors, what nearly every module returns, records nothing (the C wrapper
        stages those without coming here)."""
        try:
            kinds, held = _structure_of(value)
        except Exception:  # (a key whose str() raises...: _emit records the skip)
            return
        if kinds is None:
            return
        self._structure[call_name] = {"kinds": kinds}
        if not held:  # nothing of it is stored: where it returned among the pass's tensors
            self._structure_at[call_name] = self._staged_so_far()

    def _staged_so_far(self) -> int:
        """Tensors this Dumper staged so far: those folded into _totals and those the C++ lane holds
        uncounted, read without folding them (a fold ends the CUDA lane's batch). Under
        _counts_lock: a fold by another thread (stats()) moves counts from one to the other."""
        with self._counts_lock:
            pending = getattr(self._channel.lane, "pending_tensors", None) if self._channel is not None else 0
            if pending is None:  # (a lane without the count: the tests' CUDA-mock engines)
                self._fold_lane_counts()
                pending = 0
            # A graph being captured: its recorded tensors are the ones its replay passes will store.
            graphs = self._graphs
            recorded = graphs.open.recorded if graphs is not None and graphs.open is not None else 0
            return self._totals["tensors"] + pending + recorded

    def _capture_before(self, name: str, before, args, kwargs, k: int) -> None:
        """A watched module's ``before`` hook, and what it returns dumped as ``name[#k].<key>``."""
        call_name = _call_name(name, k)
        try:
            values = before(args, kwargs)
        except Exception as exc:
            return self._hook_failed(call_name, "before(args, kwargs)", exc)
        if values is None or not self._capturing:
            return
        if not isinstance(values, dict):
            reason = f"before(args, kwargs) returned {type(values).__name__}, not a dict or None"
            return self._hook_failed(call_name, reason, None)
        for key, value in values.items():
            item_name = f"{call_name}.{key}"
            taken = self._name_taken(item_name, key)  # its output's parts and its children's names
            if taken:
                self._skip(item_name, taken)
                continue
            self._emit_safely(item_name, value)

    # The wrappers whose steps run through `outside` (torch.compile's graph breaks, watch()'s hooks)
    # keep no number in a local: a value that changes every pass, flowing through a frame Dynamo
    # traces, would recompile it every pass. They open the call here instead; it is closed (and its
    # output captured) by _exit_call. Calls nest, so the innermost open call of a name is the one.
    def _enter_call(self, name: str, args=(), kwargs=None, inputs: bool = False, before=None) -> None:
        """A call of ``name`` starts: numbered, kept open, its ``before`` hook's values and its inputs
        (with ``inputs``) captured under its number."""
        if not self._capturing:
            return
        k = self._claim(name)
        self._open_calls.append((name, k, self.pass_id))
        if before is not None:
            self._capture_before(name, before, args, kwargs, k)
        if inputs and self._capturing:
            self._capture_inputs(name, args, kwargs, k)

    def _exit_call(self, name: str, value, convert=None) -> None:
        """The innermost open call of ``name`` returned ``value``: closed, its output captured under
        its number (numbered now if it was opened in another pass, or never)."""
        k, calls = None, self._open_calls
        for i in range(len(calls) - 1, -1, -1):
            if calls[i][0] == name:
                _, opened_k, pass_id = calls.pop(i)
                k = opened_k if pass_id == self.pass_id else None
                break
        if self._capturing:
            self._capture(name, value, convert, k)

    def _hook_failed(self, name: str, what: str, exc: Exception | None) -> None:
        reason = what if exc is None else f"{what} raised {type(exc).__name__}: {_short(exc)}"
        self._skip(name, reason)
        # Said once per hook and exception type, not per text: a text that changes every pass (a
        # request id in it) would log every pass and grow _said for as long as the model serves.
        self._say_once(("hook", what, type(exc)), "fastdump: %s: %s skipped: %s", self.dir, name, reason)

    def _emit_safely(self, name: str, value) -> None:
        try:
            self._emit(name, value, ())
        except Exception as exc:  # never into the model: the value is skipped with the reason
            self._capture_failed(name, value, exc)

    def _emit(self, name: str, value, outer: tuple) -> None:
        """Stage ``value``'s tensors under ``name``; ``outer``: ids of the containers it sits in."""
        if isinstance(value, _Tensor):
            if type(value).__name__ == "DTensor" and _is_dtensor(value):
                value = value.to_local()  # this rank's shard, as a rank of a plain TP model holds it
            if type(value).__name__ == "AsyncCollectiveTensor" and _is_async_collective(value):
                value = value.trigger_wait()  # a functional collective's result, waited for as its first use would
            return self._stage(name, value)
        if value is None or isinstance(value, (int, float, bool, str, bytes)):
            return  # not tensor data
        if hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack__"):
            return self._stage_array(name, value)
        if isinstance(value, (tuple, list, dict)) or _is_dataclass_instance(value):
            if id(value) in outer:
                return self._skip(name, "refers to a container it is inside of (self-referencing output)")
            if len(outer) >= _MAX_NESTING:
                return self._skip(name, f"nested more than {_MAX_NESTING} containers deep")
            outer = outer + (id(value),)
            if isinstance(value, (tuple, list)):
                items = enumerate(value)
            elif isinstance(value, dict):
                items = value.items()
            else:
                items = ((f.name, _MISSING) for f in dataclasses.fields(value))
            for key, item in items:
                item_name = f"{name}.<{type(key).__name__} key>"  # until the key's own text is had
                try:  # one element that cannot be read (or named) is skipped alone, not with its siblings
                    item_name = f"{name}.{key}"
                    taken = self._name_taken(item_name, key)
                    if taken:
                        self._skip(item_name, taken)
                        continue
                    if item is _MISSING:
                        item = getattr(value, key)
                    self._emit(item_name, item, outer)
                except Exception as exc:
                    self._capture_failed(item_name, value if item is _MISSING else item, exc)
            return
        self._skip(name, f"{type(value).__module__}.{type(value).__qualname__} holds no tensor fastdump can read")

    def _name_taken(self, name: str, key=None) -> str | None:
        """Why a container's part cannot be dumped as ``name``, or None (the name is its own now).
        Parts are named by their keys' text, and two keys can read alike (1 and "1"; a key holding
        a dot, "a.b", and "a" holding "b"), or a part like a module ("layers.0" returning a tuple
        whose first part reads "layers.0.0", the name of its child): a second tensor under one
        name would look mixed (verify fails) and neither could be told apart. The first keeps it.
        ``key``: the part's own key, whose text must not hold a ``#k`` part (``{"b#1": t}`` of
        module ``a`` would read as the second call of a module ``a.b``)."""
        if key is not None and _fmt.reads_as_call(str(key)):
            return "its key holds '#<digits>', which reads as a repeated call's (name#k)"
        if name in self._module_names:
            return "a part of this output reads as a module's name (its key holds a dot, or it is a module's child)"
        if self._flat_pass != self.pass_id:
            self._flat_pass, self._flat_names = self.pass_id, set()
        if name in self._flat_names:
            return ("another value of this pass has the same name (keys that read alike: 1 and '1', a dotted key, "
                    "or a key that reads as an input's name: 'input.0')")
        self._flat_names.add(name)
        return None

    def _given_name_taken(self, name: str, call_name: str) -> str | None:
        """Why a value given to dump() cannot be stored as ``call_name`` (``name`` numbered), or None.
        Its name is the caller's: one holding ``#k`` reads as a repeated call's, and ``b.0`` as the
        first part of module ``b``'s tuple output (which the C wrapper names without asking)."""
        if _fmt.reads_as_call(name):
            return "its name holds '#<digits>', which reads as a repeated call's (name#k)"
        stem = name
        while True:
            head, _, tail = stem.rpartition(".")
            if not (head and tail.isdigit()):
                break
            stem = head
            if stem in self._module_names:
                return f"its name reads as a part of module {stem!r}'s output"
        return self._name_taken(call_name) if call_name not in self._module_names else None

    def _capture_failed(self, name: str, value, exc: Exception) -> None:
        try:  # a subclass may refuse this read too: the skip must still be recorded
            nested = isinstance(value, _Tensor) and _true_is_nested(value)
        except Exception:
            nested = False
        if nested:
            reason = f"nested tensor (layout {value.layout}) is not supported"
        elif _in_a_transform(value):  # (its storage check's words would speak of a freed storage)
            reason = ("a torch.func transform's tensor (vmap, grad, jvp, functionalize): a wrapper without "
                      "values of its own; dump outside the transform")
        else:
            reason = f"cannot capture {type(value).__name__}: {type(exc).__name__}: {_short(exc)}"
        self._skip(name, reason)
        key = ("failed", type(value), type(exc)) if not nested else ("failed", reason)  # (as _hook_failed's)
        self._say_once(key, "fastdump: %s: %s skipped: %s", self.dir, name, reason)

    def _name_id(self, name: str) -> int:
        nid = self._name_ids.get(name)
        if nid is None:
            with self._names_lock:  # two threads must never give two names one id
                nid = self._name_ids.get(name)
                if nid is None:
                    nid = len(self._name_ids)
                    if not self._channel.control(protocol.name(self._channel.id, nid, name)):
                        self._channel.note_stall(name, self.pass_id)
                        return None  # `drop` with a full ring: the tensor goes too
                    self._name_ids[name] = nid
        return nid

    def _stage(self, name: str, t, code=None) -> None:
        # The hot path: for a plain CPU tensor with a known name, one call into C++, which reads the
        # tensor and counts it (folded into _totals by stats(), close() and a byte budget's check).
        # Issue 11: on a small model, every Python attribute read here cost the model's thread
        # ~0.1-0.2 us per tensor.
        new_plain = False  # a plain tensor of a new name: the hot path's turn comes once it has an id
        if code is None:
            name_id = self._name_ids.get(name)
            if name_id is not None:
                status = self._stage_fast(name_id, t)
                if status == _STAGED:
                    return
                if status != _NOT_FAST:
                    return self._account(name, status, _true_nbytes(t), t)
            # The general path: a new name, CUDA, unusual dtypes, layouts or lazy bits.
            dtype, layout, _, neg = _true_facts(t)
            fast = _FAST_CODES.get(dtype)
            if fast is None or layout is not _strided or neg:
                return self._stage_checked(name, t)
            code, itemsize = fast
            new_plain = name_id is None
        else:
            itemsize = _true_facts(t)[0].itemsize
        name_id = self._name_ids.get(name)
        if name_id is None:
            name_id = self._name_id(name)
            if name_id is None:
                return self._drop_unnamed(name)
        # A new name's first plain tensor goes the hot path's way too, so that the first pass reads
        # it as every later pass will (the tensor reader's storage check included).
        status = self._stage_fast(name_id, t) if new_plain else _NOT_FAST
        if status == _STAGED:
            return
        if status == _NOT_FAST:
            status = self._channel.stage(name_id, self.pass_id, t, code, itemsize)
        if status == _CAPTURING and self._graphs is not None:
            return self._graphs.record(name, name_id, code, t)
        if status == _UNSUPPORTED_DEVICE:
            return self._skip(name, f"tensors on {t.device.type} are not supported")
        self._account(name, status, _true_nbytes(t), t)

    def _fast_status(self, name: str, t, status: int) -> None:
        """The C++ forward wrapper's stage_tensor call returned ``status``, not STAGED: what
        _stage does with it (NOT_FAST: the general path, which tries stage_tensor once more)."""
        if status == _NOT_FAST:
            return self._stage(name, t)
        self._account(name, status, _true_nbytes(t), t)

    def _stage_checked(self, name: str, t) -> None:
        """The rare cases: unsupported dtypes and layouts, lazy conj/neg bits (complex tensors, and
        real views such as ``z.conj().imag`` that carry torch's negation bit)."""
        dtype, layout, conj, neg = _true_facts(t)
        code = _dtypes.code_of(dtype)
        if code < 0:
            return self._skip(name, _dtypes.UNSUPPORTED_REASON.get(_dtypes.torch_name(dtype), f"dtype {dtype}"))
        if layout is not _strided:
            return self._skip(name, f"layout {layout} is not strided")
        if conj or neg:  # the lazy bits are not in the bytes: resolved into a copy
            # with the caller's torch function and dispatch modes (a logging or counting mode, one
            # that changes results) and a subclass's overrides left out: they must neither see
            # fastdump's copy nor change what it holds.
            with _torch._C.DisableTorchFunction(), _torch._C._DisableTorchDispatch():
                _check_storage(t)  # torch's copy would read outside it (the model's crash)
                t = _resolve_lazy_bits(t)
        self._stage(name, t, code)

    def _drop_unnamed(self, name: str) -> None:
        self._channel.count_drop(in_ring=False)  # `drop`, ring full as its name was sent

    def _stage_array(self, name: str, array) -> None:
        name_id = self._name_id(name)
        if name_id is None:
            return self._drop_unnamed(name)
        try:
            status, nbytes = self._channel.stage_array(name_id, self.pass_id, array)
        except Exception as exc:
            return self._skip(name, f"cannot stage {type(array).__name__}: {exc}")
        self._account(name, status, nbytes, array)

    def _account(self, name: str, status: int, nbytes: int, value=None) -> None:
        """What a staging ``status`` of ``value`` (a tensor or an array of ``nbytes``) means: counted,
        dropped or skipped with the reason."""
        if status == _C.STAGED:
            self._totals["tensors"] += 1
            self._totals["bytes"] += nbytes
        elif status == _C.DROPPED:
            self._channel.count_drop()
        elif status == _C.TIMED_OUT:
            self._channel.count_drop()
            self._channel.note_stall(name, self.pass_id)
        elif status == _C.TORN:
            # The writer stalled for block_timeout_s while this tensor (larger than the ring) was
            # being staged: the part in the ring is not kept (the writer never stores part of a
            # tensor). Lost to the stall like a TIMED_OUT tensor, it is a drop (verify fails it
            # under `block`), not a skip, which says a tensor cannot be stored at all.
            self._channel.count_drop(in_ring=False)  # (the ring counts only whole tensors it refused)
            self._channel.note_stall(name, self.pass_id)
        elif status == _C.RING_TOO_SMALL:
            if self.options.policy == "block":  # staging as under `drop` since a stall (note_stall): a drop
                self._channel.count_drop(in_ring=False)
            else:
                self._skip(name, f"{nbytes} bytes do not fit in the ring at once: policy='drop' never waits "
                                 "for the writer mid-tensor (raise ring_mb)")
        elif status == _C.TOO_LARGE:  # _C.MAX_DIMS is HDF5's limit: the writer could not store it
            # or a broadcast view whose size overflows: shape x element size > 2^63 bytes
            try:
                dims = int(value.ndim)
            except Exception:
                dims = None
            if dims is not None and dims > _C.MAX_DIMS:
                self._skip(name, "more than %d dimensions" % _C.MAX_DIMS)
            elif dims is not None:
                self._skip(name, "more than 2^63 bytes (a broadcast view's shape)")
            else:
                self._skip(name, "more than %d dimensions, or more than 2^63 bytes" % _C.MAX_DIMS)
        elif status == _CAPTURING:
            # Python wrappers run only while a graph is captured, never on replay: copying then
            # would dump a capture-time value under every replay. Recorded, not staged.
            self._skip(name, "CUDA graph capture in progress (replays are not dumped)")
        else:
            self._disable(self._engine.error())

    def _skip(self, name: str, reason: str) -> None:
        if name not in self._skipped:
            self._skipped[name] = reason
            self._totals["skipped"] += 1

    # -- failure ---------------------------------------------------------------------------------
    def _disable(self, error: str, writer_stuck: bool = False) -> None:
        """Dumping stops for good; serving goes on. Said once, and recorded without waiting: a live
        writer gets it as a note (it writes rank.json; only it does); when the writer is dead,
        ``writer_stuck`` (close timed out or was interrupted), or the note finds no ring space,
        it goes to producer_error.json, which readers merge and ``verify`` fails on."""
        if self.status == "error":
            return
        self.status, self.error = "error", error
        self._capturing = False
        log.error("fastdump: dumping to %s stopped: %s", self.dir, error)
        if not writer_stuck and self._engine is not None and self._channel is not None and self._engine.alive \
                and not self._channel.failed:  # (a channel the writer stopped takes no note)
            if self._channel.control(protocol.note(self._channel.id, "error", error=error), block=False):
                return  # in the ring: the writer merges it into rank.json
        if not self._own_dir:  # (not made, or another Dumper's: its dump is not this one's to mark)
            log.error("fastdump: %s is not this Dumper's directory: the error is not recorded there", self.dir)
            return
        try:
            # Through the held directory: a path replaced by a link during the run would lead out of the dump
            write_json_atomic(self._anchor.join(_fmt.PRODUCER_ERROR_FILE),
                              {"status": "error", "error": error, "pid": os.getpid(), "time": time.time()})
        except OSError as exc:
            log.error("fastdump: cannot record the error in %s/%s: %s", self.dir, _fmt.PRODUCER_ERROR_FILE,
                      self._anchor.readable(str(exc)) if self._anchor is not None else exc)

    def _channel_failure(self) -> str:
        """Why the writer stopped writing this Dumper's directory alone: its rank.json's error."""
        error = None
        try:
            error = _load_json(self._anchor.join(_fmt.RANK_FILE)).get("error")
        except (OSError, ValueError, AttributeError):
            pass  # (never opened, unreadable: the writer's log says why)
        return str(error) if error else f"the writer stopped writing {self.dir} (its log says why)"

    def _abandon_attach(self, error: str | None, writer_stuck: bool = False) -> None:
        """Attach failed or was interrupted: record ``error`` (None: the caller raises it, strict=),
        close this Dumper's channel if it was opened (without waiting), and let go of the engine now
        (its shutdown, if this was its last Dumper, bounded by block_timeout_s), so that no
        half-started Dumper keeps the writer or its ring: a stuck writer is then killed by the
        last close, the engine's shutdown or exit. ``close()`` of such a Dumper only reports."""
        if error is not None:
            self._disable(error, writer_stuck=writer_stuck)
        try:
            if self._channel is not None and self._engine is not None and self._engine.alive:
                self._channel.control(protocol.close(self._channel.id, self._totals), block=False)
        except Exception as exc:
            log.debug("fastdump: %s: closing the channel of a failed attach: %s", self.dir, exc)
        self._release_engine(self.options.block_timeout_s)
        self._let_go_of_the_ring(fold=False)
        self._let_go_of_the_dir()

    def _release_engine(self, timeout: float = 600.0) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.release(timeout)

    # -- installing wrappers -------------------------------------------------------------------------
    def _install(self, model, root_passes: bool, **selection) -> None:
        self._model_ref = weakref.ref(_original_module(model))
        # The model's modules and names, walked before the selection: a module another thread puts in
        # while attach walks and wraps is not in it, and is caught up with once the hook is in
        # (_follow_registrations). Walked after, it was taken for one seen at attach: never dumped,
        # and the check at close, which trusts _paths, said nothing (verify OK).
        paths = _module_paths(model)
        scripted = {name: why for name, why in self.not_wrapped.items()  # (with all inside)
                    if why != _SHADOWED_REASON and name not in self._shared_left_out}
        selected = list(select_modules(model, **selection, scripted=scripted))
        root_selected = _root_selected(model, self._root_name, selection)
        if any(_original_module(m) is not m for m in model.modules()):
            # torch.compile'd (the model or a submodule): Python wrappers from the start. The C ones
            # switch at their first call in a pass, once Dynamo has met them in its first trace: a
            # graph break in the model's loop over its layers, for which Dynamo skips the model's
            # forward for good. The root wrapper of torch.compile(model) runs before Dynamo starts,
            # so never saw it either: the compiled model ran eagerly, every pass, without a word.
            self._python_wrappers = True
        chosen = {k: v for k, v in selection.items() if v is not None}
        if not selected and not root_selected and chosen:  # (a typo: FASTDUMP_MODULE_TYPES=Linaer)
            log.warning("fastdump: %s: the selection %s matches no module of the model: passes are counted, "
                        "no tensor is dumped", self.dir,
                        ", ".join(f"{k}={getattr(v, 'pattern', v)!r}" for k, v in chosen.items()))
        self._module_names.update(name for name, _ in selected)
        if root_selected:
            self._module_names.add(self._root_name)
        # Modules whose tuple output's parts would read as a selected child's name (``m.0``, a
        # Sequential's): the C wrapper names tuple parts without asking, so these take the Python
        # wrapper, which checks each part's name (_name_taken).
        self._indexed_parents = {head for head, _, tail in (n.rpartition(".") for n in self._module_names)
                                 if head and tail.isdigit()}
        for name, module in selected:
            self._wrap(module, self._capture_wrapper(name, module.forward, _owner_of(module)))
        self._follow_registrations(model, selection, paths)
        if _forward_shadowed(model):
            return  # no wrapper of the root would run: recorded in not_wrapped (no root passes)
        if root_passes:
            # Two Dumpers on this one model nest root wrapper in root wrapper at every forward: their
            # passes must not suspend each other as another model's pass nested in one does.
            self._state.root_key = id(_original_module(model))
            self._wrap(model, self._root_wrapper(self._root_name if root_selected else None, model.forward,
                                                 _owner_of(model)))
        else:
            # The root's forward outside a pass of this Dumper: see _outside_pass_wrapper. (Keyed to
            # the model as a root wrapper's passes are: another Dumper's pass on this same model is
            # not another model's, and is not suspended by this one's.)
            self._state.root_key = id(_original_module(model))
            owner = _owner_of(model)
            inner = self._capture_wrapper(self._root_name, model.forward, owner) if root_selected else None
            self._wrap(model, self._outside_pass_wrapper(inner, model.forward, owner))

    def _follow_registrations(self, model, selection: dict, paths) -> None:
        """Wrap the modules put into the model after attach (``model.layers[0] = new``, a LoRA or
        quantization wrapper set in a module's place), selected as at attach under the name they
        take: no wrapper would run for them, and their outputs were missing from every pass without
        a word (verify OK). torch calls a global module registration hook from ``__setattr__``,
        ``add_module`` and ``register_module`` (not on a direct ``_modules[name] = m``): a dict
        lookup per registration anywhere in the process while a Dumper is attached, none per forward.
        ``paths``: _module_paths(model), walked before the selection."""
        if _torch is None:
            return
        self._paths = paths
        # name -> the module its capture wrapper dumps under it (one module per name: _adopt)
        self._holders = {name: module for name, module in self._wrapped_capture()}
        # The hook is global (torch's): it holds this Dumper weakly, and goes with it. Held strongly,
        # a Dumper dropped without close() was never collected, nor its model, its rank directory's
        # descriptor or its ring: one of each per attach, for the process's life.
        me = weakref.ref(self)

        def registered(parent, name, module):
            dumper = me()
            try:  # (a module class with __eq__ and no __hash__ cannot be looked up: not ours)
                prefix = paths.get(parent) if isinstance(name, str) and dumper is not None else None
            except TypeError:
                return None
            if prefix is None or module is None:
                return None
            try:
                with dumper._lock:  # (close() on another thread: its wrappers come off before or after this)
                    if not dumper._closed:
                        full = f"{prefix}.{name}" if prefix else name
                        old = parent._modules.get(name)  # (the hook runs before the assignment)
                        if old is not None and old is not module:
                            dumper._replaced(old, module, full)
                        dumper._adopt(full, module, selection)
            except Exception as exc:  # never into the model: said, and the module goes undumped
                log.warning("fastdump: %s: %s, put into the model after attach, is not dumped: %s: %s",
                            dumper.dir, name, type(exc).__name__, _short(exc))
            return None

        self._registration_hook = _torch.nn.modules.module.register_module_module_registration_hook(registered)
        weakref.finalize(self, self._registration_hook.remove)  # (the handle's remove: a second is a no-op)
        self._selection = selection
        _follow_renumbering(self)
        with self._lock:
            self._catch_up(model, selection)

    def _catch_up(self, model, selection: dict) -> None:
        """Edits another thread made to the model while attach walked and wrapped it, before the
        registration hook was in (the hook runs before each assignment: one it missed is in the model
        by now). Each module put in is followed as the hook follows a registration, under the name
        it took; each wrapped module the model now holds elsewhere (a container replaced by a
        reordered one) or nowhere is renamed or unwrapped, as the hook's _replaced does. (An
        assignment whose registration began before the hook was in and lands after this walk stays
        unseen here: the check at close finds it, as a direct ``_modules`` write.)"""
        newcomers = []
        for name, module in named_modules(model):
            try:
                if module in self._paths:
                    continue
            except TypeError:  # (unhashable: never followed)
                continue
            if not any(_at_or_under(name, n) for n, _ in newcomers):  # (its own _adopt)
                newcomers.append((name, module))
        if not newcomers:
            return  # (the common case: nothing changed while attach ran)
        for name, module in newcomers:
            self._adopt(name, module, selection)
        held = _places(model)
        for name, holder in list(self._holders.items()):
            if self._holders.get(name) is holder and id(holder) not in held:
                self._free_name(name, None)  # (replaced while attach ran: left the model)
        self._rename({name: held[id(holder)][0] for name, holder in self._holders.items()
                      if not any(_at_or_under(p, name) for p in held[id(holder)])})
        for module in list(self._paths.keys()):
            if id(module) not in held:
                del self._paths[module]
            elif self._paths[module] not in held[id(module)]:
                self._paths[module] = held[id(module)][0]

    def _wrapped_capture(self):
        """(name, module) of the modules wrapped by a capture wrapper (not the root's)."""
        for module, wrapper in self._wrapped:
            name = getattr(wrapper, "_fastdump_name", None) or getattr(wrapper, "__fastdump_name__", None)
            if name is not None:
                yield name, module

    def _adopt(self, prefix: str, module, selection: dict) -> None:
        """Wrap what the selection keeps of ``module``, now registered in the model as ``prefix``.
        A module already wrapped keeps its wrapper and the name it had (one moved into a wrapper
        set in its place: ``model.proj = LoRA(model.proj)``), unless a module put in now takes that
        name (see _free_name)."""
        earlier = {}  # id -> the name a module of it already has in the model (held twice)
        for name, sub in named_modules(module):
            path = f"{prefix}.{name}" if name else prefix
            try:
                first = self._paths.get(sub)
            except TypeError:  # (unhashable, as above)
                continue
            if first is not None and first != path and self._still_at(first, sub):
                earlier[id(sub)] = first
            else:  # (a name it had before it left the model is stale: registrations inside it take this one)
                self._paths[sub] = path
        if any(_original_module(m) is not m for m in module.modules()):
            self._use_python_wrappers()  # a torch.compile'd module put in: as at attach (_install)
        wrapped = {id(m) for m, _ in self._wrapped}
        fresh = [(name, sub) for name, sub in _select_subtree(module, prefix, **selection) if id(sub) not in wrapped]
        for name, sub in [(n, m) for n, m in fresh if id(m) in earlier]:
            # Also under a name the selection leaves out (else it would be wrapped): as at attach
            # (selection.shared_left_out), not dumped; wrapped, the calls through the left-out name
            # read as this name's next calls (``b#1``), and verify said OK.
            fresh.remove((name, sub))
            self.not_wrapped[earlier[id(sub)]] = _SHARED_LEFT_OUT.format(kept=name)
            log.warning("fastdump: %s: not wrapped: %s: %s", self.dir, earlier[id(sub)],
                        self.not_wrapped[earlier[id(sub)]])
        for name, _ in fresh:
            self._free_name(name, prefix)
        self._module_names.update(name for name, _ in fresh)
        self._indexed_parents |= {head for head, _, tail in (name.rpartition(".") for name, _ in fresh)
                                  if head and tail.isdigit()}  # (as _install: these take the Python wrapper)
        for name, sub in fresh:
            self._wrap(sub, self._capture_wrapper(name, sub.forward, _owner_of(sub)))
            self._holders[name] = sub
        if fresh:
            log.info("fastdump: %s: %s put into the model after attach: dumped too", self.dir,
                     ", ".join(name for name, _ in fresh))

    def _still_at(self, name: str, module) -> bool:
        """Whether the model holds ``module`` under ``name`` now."""
        model = self._model_ref()
        if model is None:
            return False
        for path, sub in named_modules(model, remove_duplicate=False):
            if path == name:
                return sub is module
        return False

    def _free_name(self, name: str, replaced: str | None) -> None:
        """A module put in now takes ``name``, which another wrapped module dumps under: two modules
        under one name read as one module called twice (``del model.layers[1]`` renumbers the rest
        unseen, and ``append`` then put a new ``layers.2`` beside the old one: ``layers.2#1``, verify
        OK). The holder is dumped under the name it has in the model now; one only under ``replaced``
        (the slot being filled: the hook runs before the assignment) or nowhere is leaving the model,
        and is not dumped any more."""
        holder = self._holders.pop(name, None)
        if holder is None:
            return
        model = self._model_ref()
        now = None
        if model is not None:
            for path, sub in named_modules(model):
                if sub is holder and (replaced is None or not _at_or_under(path, replaced)):
                    now = path
                    break
        if not self._unwrap_one(holder):
            self._holders[name] = holder  # someone wrapped over ours: it cannot be taken off (kept)
            return
        self._module_names.discard(name)
        if now is not None:
            self._free_name(now, replaced)  # (its holder left the model: a deleted layer, say)
        if now is not None and now not in self._holders:
            self._paths[holder] = now
            self._module_names.add(now)
            self._wrap(holder, self._capture_wrapper(now, holder.forward, _owner_of(holder)))
            self._holders[now] = holder

    def _unwrap_one(self, module) -> bool:
        """Take this Dumper's capture wrapper off ``module`` (False: another wrapper sits over it)."""
        for i, (m, wrapper) in enumerate(self._wrapped):
            if m is module:
                if module.__dict__.get("forward") is not wrapper:
                    return False
                _put_back(module, wrapper)
                if not _is_ours(module.__dict__.get("forward")):
                    _remove_copier(module)
                del self._wrapped[i]
                return True
        return False

    def _renumbered(self, container, before: dict) -> None:
        """``container`` (a ModuleList or Sequential) renumbered its modules without a registration
        (``insert``, ``del``, ``pop``: their ``_modules`` writes call no hook): ``before``, its
        modules then. A module inserted was never wrapped (its outputs missing, verify OK), and the
        ones after it, or after a deleted one, dumped under the number they had: names that now
        lead to another module. Each moved module's names follow its new number; an inserted one
        is wrapped (_adopt)."""
        try:
            prefix = self._paths.get(container)
        except TypeError:
            return
        if prefix is None or self._closed:
            return
        join = (lambda key: f"{prefix}.{key}") if prefix else (lambda key: key)
        old_key = {}
        for key, module in before.items():
            old_key.setdefault(id(module), key)
        # A module held at several numbers is named by its first, as at attach: its first number
        # before against its first now (not each later number it is also held at).
        new_key = {}
        for key, module in container._modules.items():
            if module is not None:
                new_key.setdefault(id(module), (key, module))
        moves, added = {}, []
        for key, module in new_key.values():
            was = old_key.get(id(module))
            if was is None:
                added.append((join(key), module))
            elif was != key:
                moves[join(was)] = join(key)

        self._rename(moves)
        for name, module in added:
            self._adopt(name, module, self._selection)
        kept = {id(m) for m in container._modules.values()}
        gone = [m for m in before.values() if m is not None and id(m) not in kept]
        if gone:
            self._removed(gone)

    def _rename(self, moves: dict) -> None:
        """Wrapped modules that the model now holds at another place: ``moves`` maps each old name
        to its new one (the names inside a moved module move with it). Each is dumped under its new
        name from now on."""
        if not moves:
            return

        def moved(name):  # (the most specific: a module's own move before its parent's)
            best = None
            for old in moves:
                if _at_or_under(name, old) and (best is None or len(old) > len(best)):
                    best = old
            return None if best is None else moves[best] + name[len(best):]

        for module, name in list(self._paths.items()):  # the names registrations inside them take
            if moved(name) is not None:
                self._paths[module] = moved(name)
        renamed = [(holder, moved(name)) for name, holder in list(self._holders.items()) if moved(name) is not None]
        for holder, _ in renamed:  # all off first: one's new name may be another's old one
            name = next(n for n, h in self._holders.items() if h is holder)
            if self._unwrap_one(holder):
                del self._holders[name]
                self._module_names.discard(name)
        for holder, name in renamed:
            if any(h is holder for h in self._holders.values()):
                continue  # (someone wrapped over ours: kept as it was)
            self._free_name(name, None)  # (a module deleted from that number)
            self._module_names.add(name)
            self._wrap(holder, self._capture_wrapper(name, holder.forward, _owner_of(holder)))
            self._holders[name] = holder

    def _replaced(self, old, new, name: str) -> None:
        """``new`` is about to take ``old``'s place ``name``: the wrapped modules of ``old`` that ``new``
        does not hold (a LoRA holds the module it wraps) leave the model with it, unless it holds them
        elsewhere (_free_name). They kept their wrappers and names: a pruned ``lm_head`` replaced by a
        module around a new Linear was still wrapped as ``lm_head``, a module the model no longer had."""
        staying = {id(sub) for sub in new.modules()}
        leaving = {id(sub) for sub in old.modules()} - staying
        for held, holder in list(self._holders.items()):
            if id(holder) in leaving and self._holders.get(held) is holder:
                self._free_name(held, name)
        # Their names leave _paths: a module put back elsewhere, or run outside the model, then given a
        # submodule had it wrapped under its old place's name (``block.extra`` for ``other.extra``,
        # verify OK). No walk of the model here (a quantization pass registers every Linear): one also
        # held elsewhere loses its name too, and what is registered in it later goes unfollowed, which
        # the check at close reports (verify fails), never dumped under a wrong name.
        for sub in old.modules():
            try:
                path = self._paths.get(sub) if id(sub) in leaving else None
            except TypeError:  # (unhashable: not in it)
                continue
            if path is not None and _at_or_under(path, name):
                del self._paths[sub]
        if id(old) not in staying:
            # Not a wrapper around ``old``: a container replaced by another that holds some of its
            # modules elsewhere (``model.layers = model.layers[2:]``, a reordered ModuleList). They
            # kept their old numbers, names that now lead to other modules or to none (layers.3
            # held the first layer's output, verify OK): each takes the name it has in ``new``.
            self._rename(_moves_within(old, new, name))

    def _removed(self, gone: list) -> None:
        """The modules ``gone`` left their place in the model (``delattr``, a ModuleDict's ``del``,
        ``pop``, ``clear``, a ModuleList's last one deleted): each wrapped module in them kept its
        wrapper and its old name, so run from outside the model it was dumped under a name that no
        longer leads to it, and put back elsewhere it kept that name. Each is dumped under the name
        the model has for it now, or not at all (_free_name); the names inside them are forgotten,
        so a module registered in one later is not dumped under its old place's name."""
        inside = {id(sub) for module in gone for sub in module.modules()}
        for name, holder in list(self._holders.items()):
            if id(holder) in inside and self._holders.get(name) is holder:
                self._free_name(name, None)
        self._forget_paths(inside)

    def _forget_paths(self, inside: set) -> None:
        """The modules of ids ``inside`` left their place: each keeps in ``_paths`` the name the
        model holds it under elsewhere, or none."""
        model = self._model_ref()
        if model is None:
            return
        held = _places(model)
        for module, name in list(self._paths.items()):
            if id(module) in inside:
                if id(module) in held:
                    self._paths[module] = held[id(module)][0]  # (still held under another name)
                else:
                    del self._paths[module]

    def _not_followed(self) -> list:
        """The model's tree against the wrappers, at close: ``"name: what"`` for each selected module
        in the model that no capture wrapper of this Dumper dumps, and each wrapped module the model
        no longer holds. Writes straight to a module's ``_modules`` (``torch.ao.quantization.convert``,
        ``swap_submodule``, ``del parent._modules[k]``) call no hook: such a module put in was never
        dumped, one taken out was dumped under a name that no longer leads to it, and verify said OK.
        One walk of the model, at close only (none per pass)."""
        model = self._model_ref() if getattr(self, "_holders", None) is not None else None
        if model is None:
            return []
        # Left out of the selection with what is in them: what attach left unwrapped with its subtree
        # (TorchScript, a name like a repeated call's, a shared module's left-out name). A module
        # whose forward is shadowed is not selected itself, but its submodules are dumped: one put in
        # there unseen is an unfollowed edit like any other.
        scripted = {name: why for name, why in self.not_wrapped.items() if why != _SHADOWED_REASON}
        held = _places(model)
        wrapped = {id(module) for module, wrapper in self._wrapped if getattr(wrapper, "_fastdump_name", None)
                   or getattr(wrapper, "__fastdump_name__", None)}
        found = []
        for name, module in select_modules(model, **self._selection, scripted=scripted):
            try:  # (one the Dumper saw put in is not an unseen edit: a container emptied since is a leaf now)
                seen = module in self._paths
            except TypeError:  # (unhashable: never followed, not judged)
                continue
            if not seen and id(module) not in wrapped:
                found.append(f"{name}: in the model and selected, not dumped (put in by a write to a "
                             "module's _modules, which no hook reports)")
        for name, module in self._holders.items():
            if id(module) not in held:
                found.append(f"{name}: wrapped, and the model no longer holds it (taken out by a write to a "
                             "module's _modules, which no hook reports): its calls since, if any, dumped under this name")
            elif not any(_at_or_under(path, name) for path in held[id(module)]):
                # Moved by a write to _modules (two modules' places swapped): its calls since were dumped
                # under its old name, which now leads to another module (or to none). (Under its old
                # place is no move: a LoRA-style wrapper set there holds it, and it keeps its name, _adopt.)
                found.append(f"{name}: wrapped, and the model holds it as {', '.join(sorted(held[id(module)]))} now "
                             "(moved by a write to a module's _modules, which no hook reports): its calls since, "
                             "if any, dumped under this name")
        return found

    def _wrap(self, module, wrapper) -> None:
        _mark_ours(wrapper, module.__dict__.get("forward", _MISSING))
        module.__dict__["forward"] = wrapper
        _install_copier(module)
        self._wrapped.append((module, wrapper))

    def _unwrap(self) -> None:
        for token in self._tokens:
            _GRAPH_TOKENS.pop(token, None)
        self._tokens.clear()
        hook = getattr(self, "_registration_hook", None)
        if hook is not None:
            hook.remove()
            self._registration_hook = None
        for module, wrapper in reversed(self._wrapped):
            if module.__dict__.get("forward") is wrapper:
                _put_back(module, wrapper)
            else:
                # Someone wrapped over us: become a pass-through. A Dumper whose wrapper sits over
                # ours restores what ours wraps when it closes (_skip_stale).
                wrapper.__fastdump_off__ = True
            if not _is_ours(module.__dict__.get("forward")):
                _remove_copier(module)
        self._wrapped.clear()

    def _capture_wrapper(self, name: str, forward, owner=None):
        """The wrapper of a selected module: the C++ ForwardWrapper (csrc/forward_wrapper.cpp),
        or the Python one where that cannot do the job."""
        if _NativeWrapper is not None and _native_wrappers and not self._python_wrappers and \
                name not in self._indexed_parents:
            return _wraps(forward)(_NativeWrapper(self._state, name, forward, self.inputs, owner))
        return self._python_capture_wrapper(name, forward, owner)

    def _python_capture_wrapper(self, name: str, forward, owner=None):
        """The same wrapper in Python: what _capture_wrapper falls back to; tests run both."""
        dumper = self
        inputs = self.inputs
        original, forward = forward, _following(owner, forward)
        token = self._graph_token(name)

        @_wraps(original)  # keeps the signature: transformers' generate() inspects it
        def forward_and_capture(*args, **kwargs):
            if not dumper._capturing:
                return forward(*args, **kwargs)
            if _is_compiling():  # torch.compile is tracing us: stage the real values at graph breaks
                if _no_graph_breaks(token):  # fullgraph=True: none allowed; served undumped, counted
                    return forward(*args, **kwargs)
                if inputs:  # numbered as it starts, as eagerly (one graph break before, as ever)
                    _outside_graph(dumper._enter_call, name, args, kwargs, True)
                    out = forward(*args, **kwargs)
                    _outside_graph(dumper._exit_call, name, out)
                else:  # numbered as it returns: no second graph break per module (docs/INTERNALS.md)
                    out = forward(*args, **kwargs)
                    _outside_graph(dumper._capture, name, out)
                return out
            pass_id = dumper.pass_id
            k = dumper._claim(name)  # numbered as it starts (see _claim)
            if inputs:  # before forward: it may change its inputs in place
                dumper._capture_inputs(name, args, kwargs, k)
            out = forward(*args, **kwargs)
            if dumper._capturing:
                if dumper.pass_id != pass_id:
                    k = None  # its pass ended inside the call: numbered in the new one
                if k == 0 and type(out) is _TensorType:  # the common case, inlined: first call, one tensor
                    try:  # free in 3.11 unless raised: nothing fastdump does may raise into the model
                        dumper._stage(name, out)
                    except Exception as exc:
                        dumper._capture_failed(name, out, exc)
                else:
                    dumper._capture(name, out, None, k)
            return out

        # A code object of its own: Dynamo keeps its compiled frames per code object, and where it
        # compiles the wrappers as frames (the model's own frame skipped, as Dynamo does for a graph
        # break in its loop over the layers) every module's wrapper was a recompile of one code
        # object, until Dynamo's recompile limit (8) sent the rest to eager, every pass.
        forward_and_capture.__code__ = forward_and_capture.__code__.replace()
        forward_and_capture.__fastdump_name__ = name  # (the C wrapper's _fastdump_name)
        return forward_and_capture

    def _hooked_wrapper(self, name: str, forward, convert, before, owner=None):
        """A watched module's wrapper (watch): the capture wrapper's rules plus the hooks. It stays
        Python, and off the hot path of plain leaves."""
        dumper = self
        inputs = self.inputs
        original, forward = forward, _following(owner, forward)
        token = self._graph_token(name)

        @_wraps(original)
        def forward_and_capture(*args, **kwargs):
            if not dumper._capturing:
                return forward(*args, **kwargs)
            # torch.compile tracing us: the hooks and the staging run eagerly, at graph breaks
            outside = _outside_graph if _is_compiling() else _call
            if outside is not _call and _no_graph_breaks(token):  # fullgraph=True: served undumped, counted
                return forward(*args, **kwargs)
            if before is not None or inputs or outside is _call:  # numbered as it starts (see _claim)
                outside(dumper._enter_call, name, args, kwargs, inputs, before)
                out = forward(*args, **kwargs)
                outside(dumper._exit_call, name, out, convert)
                return out
            out = forward(*args, **kwargs)  # compiled, nothing before forward: numbered as it returns
            if dumper._capturing:
                outside(dumper._capture, name, out, convert)
            return out

        forward_and_capture.__code__ = forward_and_capture.__code__.replace()  # (as _python_capture_wrapper)
        return forward_and_capture

    def _graph_token(self, name: str) -> int:
        """A number naming (this Dumper, ``name``) for _no_graph_breaks, which Dynamo calls with
        constants only; forgotten at close."""
        token = next(_GRAPH_TOKEN_COUNT)
        _GRAPH_TOKENS[token] = (weakref.ref(self), name)
        self._tokens.append(token)
        return token

    def _traced_without_graph_breaks(self, name: str) -> None:
        """Dynamo traced ``name``'s wrapper into a graph that may not break (``torch.compile(...,
        fullgraph=True)``, ``torch._dynamo.error_on_graph_break``): staging needs a graph break, so
        that compiled code runs undumped. The modules so traced are counted (``compiled_not_dumped``,
        which fails ``fastdump verify``) and logged: before, such a compile raised into the model."""
        if name in self._strict_graph_names:  # (Dynamo may trace a frame more than once)
            return
        self._strict_graph_names.add(name)
        self._totals["compiled_not_dumped"] = len(self._strict_graph_names)
        self._use_python_wrappers()  # Dynamo reads the leaves' forward after this: not the C ones
        if "fullgraph" not in self._said:
            self._said.add("fullgraph")
            log.warning("fastdump: %s: %s is compiled without graph breaks (torch.compile fullgraph=True): "
                        "the modules in that graph are served undumped (stats compiled_not_dumped; verify "
                        "fails). Compile without fullgraph=True to dump them.", self.dir, name)

    def _use_python_wrappers(self) -> None:
        """torch.compile is tracing the model: from now on its modules get the Python wrapper.

        Dynamo cannot trace C, so at a C++ ForwardWrapper it graph-breaks and runs that module's
        forward (torch.nn code, which it does not compile on its own) eagerly: a compiled model
        would compile nothing it dumps. Dynamo inlines the Python wrapper instead, compiling each
        module's code and breaking only around the staging calls (_outside_graph). Wrappers another
        wrapper now sits over are left alone."""
        if self._python_wrappers:
            return
        self._python_wrappers = True
        for i, (module, wrapper) in enumerate(self._wrapped):
            if type(wrapper) is _NativeWrapper and module.__dict__.get("forward") is wrapper:
                python = self._python_capture_wrapper(wrapper._fastdump_name, wrapper._fastdump_forward,
                                                      wrapper._fastdump_owner)
                _mark_ours(python, _wrapped_by(wrapper))
                module.__dict__["forward"] = python
                self._wrapped[i] = (module, python)

    def _root_wrapper(self, name, forward, owner=None):
        dumper = self
        original, forward = forward, _following(owner, forward)
        # The root's own output (when selected) is captured by a C++ ForwardWrapper inside the pass,
        # as any selected module's: a tuple of logits and hidden states is staged without the
        # Python path's frames (~45 us a pass in the micro decode loop, benchmarks/RESULTS.md 0i).
        # Under torch.compile the Python path below runs, which Dynamo can trace.
        native = None
        if name is not None and _NativeWrapper is not None and _native_wrappers and not self._python_wrappers \
                and name not in self._indexed_parents:
            native = _NativeWrapper(self._state, name, original, self.inputs, owner)
        # The pass's begin and end around it in C too, in the common case (CaptureState.root_pass:
        # ~40-110 us a pass in Python in the micro decode loop, mostly cache misses; RESULTS.md 0l).
        root_pass = self._state.root_pass if native is not None and _native_root_pass else None
        token = self._graph_token(name if name is not None else self._root_name)

        @_wraps(original)
        def forward_in_pass(*args, **kwargs):
            if getattr(forward_in_pass, "__fastdump_off__", False):
                return forward(*args, **kwargs)
            if _is_exporting():  # torch.export traces a graph from fake tensors: nothing to dump, no pass
                return forward(*args, **kwargs)
            outside = _outside_graph if _is_compiling() else _call  # once per pass: cheap
            if outside is not _call and _no_graph_breaks(token):  # fullgraph=True: no pass; counted
                return forward(*args, **kwargs)
            if outside is _call and _fake_mode_active():  # a shape or memory estimate: no values, no pass
                return forward(*args, **kwargs)  # (a pass of skips would shift every later pass id)
            if root_pass is not None and outside is _call and not dumper._python_wrappers:
                out = root_pass(native, args, kwargs)  # this function's pass, as below (C)
                if dumper._dropped_lazy:
                    dumper._close_dropped_lazy()
                if type(out) in _LAZY_STAND_INS:  # (a generator: its work runs after the pass ended)
                    return dumper._lazy_result(out, after_pass=True)
                return out
            if outside is not _call and not dumper._python_wrappers:
                outside(dumper._use_python_wrappers)  # before Dynamo meets the C++ wrappers
            outside(dumper._root_begin)
            try:
                if native is not None and outside is _call and not dumper._python_wrappers:
                    out = native(*args, **kwargs)  # inputs and output captured in C++, as for a leaf
                elif name is not None and dumper._capturing and (dumper.inputs or outside is _call):
                    outside(dumper._enter_call, name, args, kwargs, dumper.inputs)  # numbered as it starts
                    out = forward(*args, **kwargs)
                    outside(dumper._exit_call, name, out)
                else:
                    out = forward(*args, **kwargs)
                    if name is not None and dumper._capturing:  # compiled, no inputs: numbered as it returns
                        outside(dumper._capture, name, out)
            except BaseException as exc:
                outside(dumper._forward_raised, exc)
                raise
            finally:
                outside(dumper._end)
                if dumper._dropped_lazy:
                    outside(dumper._close_dropped_lazy)
            if type(out) in _LAZY_STAND_INS:  # (a generator: its work runs after the pass ended)
                return dumper._lazy_result(out, after_pass=True)
            return out

        return forward_in_pass

    def _outside_pass_wrapper(self, inner, forward, owner=None):
        """The root's wrapper with ``root_passes=False`` (``inner``: its capture wrapper when the root
        is selected, else None). Run while no pass of this Dumper is open, on a thread where another
        Dumper's pass is (an EAGLE draft run inside the target's forward without a pass of its own),
        it suspends that pass until it returns: the modules both wrap (the shared embedding and LM
        head) would otherwise put this model's calls into the other model's pass as ``embed#1``,
        indistinguishable from that model calling them twice, and verify said OK. The suspended pass
        records it (``suspended_for``, pass null: this model's calls went to no pass)."""
        dumper = self
        original, forward = forward, _following(owner, forward)
        if inner is None:
            inner = forward

        @_wraps(original)
        def forward_outside_passes(*args, **kwargs):
            if getattr(forward_outside_passes, "__fastdump_off__", False):
                return inner(*args, **kwargs)  # closed
            if dumper._depth > 0:  # in a pass of its own (which suspended the others)
                out = inner(*args, **kwargs)
                # (its steps are that pass's; dropped unconsumed in a later pass, its stand-in keeps
                # the cleanup out of that one: _close_dropped)
                return dumper._lazy_result(out, after_pass=False) if type(out) in _LAZY_STAND_INS else out
            outside = _outside_graph if _is_compiling() else _call
            held = len(dumper._forwards_outside_passes)
            try:  # (Ctrl-C between the suspend and the forward: still resumed)
                outside(dumper._suspend_for_forward)  # (the common case: no other pass open here, nothing)
                out = inner(*args, **kwargs)
            finally:
                if len(dumper._forwards_outside_passes) > held:
                    outside(dumper._resume_after_forward)
            if type(out) in _LAZY_STAND_INS:  # (a generator: its work runs when consumed, after this returned)
                return dumper._lazy_result(out, after_pass=False)
            return out

        return forward_outside_passes

    def _lazy_result(self, out, after_pass: bool):
        """The root forward returned a generator, coroutine or async generator (fastdump/capture/lazy.py):
        a stand-in whose every step runs as this model's forward outside its passes. ``after_pass``: a
        root_passes=True wrapper, whose pass has ended with none of that work in it; said once."""
        if after_pass:
            self._say_once("lazy", "fastdump: %s: the root forward returned a %s: its modules run when it is "
                                   "consumed, after the pass ended, and are not dumped; attach with "
                                   "root_passes=False and open the passes with begin_pass()/end_pass() around "
                                   "its consumption", self.dir, type(out).__name__)
        return _LAZY_STAND_INS[type(out)](out, self)

    def _step_outside_passes(self, step, *args):
        """One step of a root forward's lazy result (_lazy_result), run as the forward itself runs in
        _outside_pass_wrapper: inside a pass of this Dumper it is that pass's; outside, the passes of
        other Dumpers open on this thread are suspended while it runs."""
        if self._depth > 0 or self._closed:
            return step(*args)
        held = len(self._forwards_outside_passes)
        try:
            self._suspend_for_forward()
            return step(*args)
        finally:
            if len(self._forwards_outside_passes) > held:
                self._resume_after_forward()

    def _close_dropped(self, inner) -> None:
        """A lazy result dropped unconsumed (lazy._Lazy.__del__): close it now, outside passes as its
        steps ran. While a pass of this Dumper is open (the stand-in was freed inside it, on any
        thread), the ``finally`` blocks it runs then would put their module calls into that pass, as
        if its forward had made them (``lm_head`` of a cleanup step, verify OK): it is closed once
        that pass has ended instead, outside it (_close_dropped_lazy)."""
        state = self._state
        if self._closed:
            # This Dumper is gone, but its model may be attached again: a pass of that Dumper got the
            # cleanup's calls as its own (verify OK). Closed as that Dumper's own dropped result.
            heir = next((d for d in list(_open_dumpers) if d is not self and not d._closed
                         and d._pid == os.getpid() and d._model_holds(self._model_ref)), None)
            if heir is not None:
                return heir._close_dropped(inner)
        elif self._depth > 0 or state.capturing or state.suspended:
            self._dropped_lazy.append(inner)
            return
        self._step_outside_passes(inner.close)

    def _close_dropped_lazy(self) -> None:
        """Close the lazy results dropped during the pass that just ended (_close_dropped), unless a
        pass is open again (nested, another thread's): then at its end. What their ``finally``
        blocks raise is logged, as the garbage collector would have reported it."""
        state = self._state
        while self._dropped_lazy and (self._closed or not (self._depth > 0 or state.capturing or state.suspended)):
            inner = self._dropped_lazy.pop(0)
            try:
                self._step_outside_passes(inner.close)
            except Exception as exc:
                log.error("fastdump: %s: closing a dropped %s raised %s: %s", self.dir, type(inner).__name__,
                          type(exc).__name__, _short(exc))

    def _step_dropped_cleanup(self, step, *args):
        """One step of the ``aclose()`` an event loop runs for an async generator of this Dumper's
        dropped unconsumed (lazy._Cleanup): as any step, unless a pass of this Dumper is open (across
        an ``await``): it cannot be put off as a generator's close is (_close_dropped), the loop runs
        it now; the pass is marked mixed, naming why (verify fails), as its calls read as its forward's."""
        state = self._state
        if not self._closed and (self._depth > 0 or state.capturing or state.suspended):
            self._mixed = True  # (verify fails on it: calls that are not this pass's forward, told apart by none)
            self._mark_incomplete("the cleanup of an async generator dropped unconsumed ran inside this pass "
                                  "(its event loop closed it here): its module calls are in it")
        return self._step_outside_passes(step, *args)

    def _suspend_for_forward(self) -> bool:
        """The root's forward starts outside any pass of this Dumper (_outside_pass_wrapper): suspend
        the passes of other Dumpers open on this thread. Whether it suspended any."""
        outer = self._state.suspend_others()
        if not outer:
            return False
        if not self._forwards_outside_passes and any(other._model_holds(self._model_ref) for other in outer):
            # This model is part of that pass's model (a Dumper on one of its submodules, dumping on
            # demand): its forward is that model's own computation, which that pass keeps.
            self._state.resume_held()
            return False
        self._forwards_outside_passes.append(outer)  # first: from here on the wrapper resumes them
        for other in outer:
            other._note_suspended_for(self.role, None)
        return True

    def _model_holds(self, model_ref) -> bool:
        """Whether ``model_ref()`` is this Dumper's model or one of its submodules (cached per model:
        asked only where passes nest, a walk of the model's modules the first time)."""
        held = self._holds_models.get(model_ref)
        if held is None:
            mine, other = self._model_ref(), model_ref()
            held = mine is not None and other is not None and any(m is other for m in mine.modules())
            if len(self._holds_models) < 64:  # (a few models per process)
                self._holds_models[model_ref] = held
        return held

    def _resume_after_forward(self) -> None:
        """That forward returned (or raised): what it suspended captures again, unless a pass of
        this Dumper begun inside it is still open (its end resumes them)."""
        self._forwards_outside_passes.pop()
        if self._depth == 0 and not self._forwards_outside_passes:
            self._state.resume_held()

    def _note_suspended_for(self, role: str, pass_id) -> None:
        """This Dumper's open pass was suspended while a pass of ``role`` (``pass_id``; None: a
        forward of that role's model outside any pass of its own) ran inside it on its thread: in
        its meta, ``suspended_for``, so a reader sees the gap and can put the roles' passes in order."""
        entries = self._meta.setdefault("suspended_for", [])
        if len(entries) < _MAX_SUSPENDED_FOR:
            entries.append({"role": role, "pass": pass_id})
        else:  # (a manual pass around thousands of draft steps: the count, not the list)
            self._meta["suspended_for_left_out"] = self._meta.get("suspended_for_left_out", 0) + 1

    def _capture_inputs(self, name: str, args, kwargs, k=None) -> None:
        """The inputs of the call numbered ``k`` (see _claim), dumped as ``name[#k].input.<i|key>``."""
        # (k None: the C wrapper could not number the call at its start: the number the next call gets)
        base = _call_name(name, self._calls.get(name, 0) if k is None else k)
        if not self._capturing:
            return
        # Each input's name is claimed like a container part's: an output dict's key "input.0", or a
        # keyword argument named "0" (a forward taking **kwargs), reads as the same name.
        named = [(i, arg) for i, arg in enumerate(args)] + list(kwargs.items())
        for key, arg in named:
            item_name = f"{base}.input.{key}"
            taken = self._name_taken(item_name, key)
            if taken:
                self._skip(item_name, taken)
                continue
            self._emit_safely(item_name, arg)


class _ManualPass:
    """What ``Dumper.manual_pass`` returns: the with-block is the pass (its frame, the opener)."""

    __slots__ = ("dumper", "meta")

    def __init__(self, dumper: Dumper, meta: dict):
        self.dumper, self.meta = dumper, meta

    def __enter__(self) -> Dumper:
        self.dumper._begin_manual(self.meta, sys._getframe(1))
        return self.dumper

    def __exit__(self, kind, exc, tb) -> bool:
        self.dumper.end_pass(None if exc is None else f"a forward raised {type(exc).__name__}: {_short(exc)}")
        return False


# ------------------------------------------------------------------------------------------------
# helpers

_MISSING = object()
_MAX_NESTING = 32  # containers inside containers in one output; deeper is skipped with the reason
_CAPTURING = _C.CAPTURING
_UNSUPPORTED_DEVICE = _channel_mod.UNSUPPORTED_DEVICE  # CudaStager.stage: the producer stream is being captured
_STAGED = _C.STAGED
_NOT_FAST = _C.ChannelStager.NOT_FAST  # ChannelStager.stage_tensor: take the general path
_NativeWrapper = getattr(_C, "ForwardWrapper", None)  # csrc/forward_wrapper.cpp
_native_wrappers = True  # False: every selected module gets the Python wrapper (tests of both)
_native_root_pass = True  # False: a root forward's pass begins and ends in Python (tests of both)

try:  # torch is a dependency of every model we dump; import it once, here
    import torch as _torch

    _Tensor = _torch.Tensor
    _TensorType = _torch.Tensor  # exact type: subclasses (Parameter, DTensor...) take the general path
    _strided = _torch.strided
except ImportError:  # pragma: no cover - fastdump.open and the CLI work without torch
    _torch = None
    _Tensor = _TensorType = type("NoTensor", (), {})
    _strided = None


def _fast_codes() -> dict:
    """dtype -> (wire code, element size) for the dtypes the hot path stages without further checks.

    Complex dtypes are left out: their lazy conj/neg bits must be resolved first.
    """
    if _torch is None:
        return {}
    codes = {}
    for name in _dtypes.NAMES:
        dtype = getattr(_torch, name, None)
        if isinstance(dtype, _torch.dtype) and not dtype.is_complex:
            codes[dtype] = (_dtypes.CODE_BY_NAME[name], dtype.itemsize)
    return codes


# The root wrapper's code (see Dumper._root_begin): the frame that opened a pass is one of it.
_ROOT_CODE = next(c for c in Dumper._root_wrapper.__code__.co_consts
                  if isinstance(c, types.CodeType) and c.co_name == "forward_in_pass")
_FAST_CODES = _fast_codes()


def _true_facts(t) -> tuple:
    """(dtype, layout, is_conj, is_neg) of ``t`` as its TensorImpl holds them. A subclass's Python
    overrides and torch function modes are not asked (as channel.host_layout does for the shape and
    address): a ``dtype`` claimed wider than the elements had the copy read the storage's next
    bytes as that type, dumped as such (the attribute path, without the tensor reader). An exact
    torch.Tensor has no overrides: its attributes are read directly (a third of the cost)."""
    if type(t) is _TensorType:
        return t.dtype, t.layout, t.is_conj(), t.is_neg()
    with _torch._C.DisableTorchFunction():
        return _TensorType.dtype.__get__(t), _TensorType.layout.__get__(t), _TensorType.is_conj(t), \
            _TensorType.is_neg(t)


def _true_nbytes(t) -> int:
    """``t``'s size in bytes as its TensorImpl holds it. Read after ``t`` was staged: a subclass's
    ``nbytes`` (its __torch_function__ may answer a string, or raise) made a staged tensor a
    recorded skip too, under a wrong reason, and left its bytes out of the totals."""
    if type(t) is _TensorType:
        return t.nbytes
    with _torch._C.DisableTorchFunction():
        return _TensorType.nbytes.__get__(t)


def _true_is_nested(t) -> bool:
    """Whether ``t`` is a nested tensor, as its TensorImpl says (a subclass's answer may be any
    truthy object: "layout junk" was reported as a nested tensor)."""
    with _torch._C.DisableTorchFunction():
        return bool(_TensorType.is_nested.__get__(t))


def _check_storage(t) -> None:
    """ValueError (the tensor's recorded skip) unless ``t``'s storage holds every element ``t``
    addresses. torch lets a storage be freed or shrunk under its tensors (``untyped_storage().
    resize_(0)``, as FSDP does), and its own copies do not check: resolving a lazy conj/neg view of
    such a storage crashed the served process (SIGSEGV) or read another allocation. The check the
    tensor reader and ChannelStager make before their copies, for the copy made before them.
    Called with torch function modes off."""
    T = _TensorType
    sizes, strides = T.size(t), T.stride(t)
    if 0 in sizes:
        return
    try:
        storage = T.untyped_storage(t)
    except RuntimeError:  # a wrapper subclass: no storage of its own
        raise ValueError(_C.NO_DATA) from None
    last = sum((n - 1) * s for n, s in zip(sizes, strides))
    if storage.data_ptr() == 0 or (T.storage_offset(t) + last + 1) * T.element_size(t) > storage.nbytes():
        raise ValueError(_C.STORAGE_SHORT)


def _resolve_lazy_bits(t):
    """``t`` with its conj/neg bits applied to a copy of its bytes, at the cost of the storage range
    it addresses when that is smaller than its shape: a broadcast view (``expand``) of one complex
    element resolves one element, not every element of the shape (a 1 GiB copy on the model's
    thread, for a tensor the ring might not even take). Called with torch function and dispatch
    modes off (see _stage_checked)."""
    T = _TensorType
    sizes, strides = T.size(t), T.stride(t)
    numel = T.numel(t)
    extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides))  # elements from the first to the last
    if numel == 0 or extent >= numel:  # (a dense or sparse-strided tensor: resolving it whole costs least)
        return T.resolve_neg(T.resolve_conj(t))
    span = T.resolve_neg(T.resolve_conj(T.as_strided(t, (extent,), (1,))))  # t's range of its storage
    return T.as_strided(span, sizes, strides, 0)


def _call(fn, *args):
    return fn(*args)


_CALL_CODE = _call.__code__


if _torch is not None and hasattr(_torch, "_disable_dynamo"):
    _is_compiling = _torch.compiler.is_compiling
    _is_exporting = getattr(_torch.compiler, "is_exporting", lambda: False)
    try:  # a FakeTensorMode is active (its forward computes shapes, not values)
        _FAKE_MODE = _torch._C._TorchDispatchModeKey.FAKE

        def _fake_mode_active() -> bool:
            return _torch._C._get_dispatch_mode(_FAKE_MODE) is not None
    except AttributeError:  # pragma: no cover - a torch without the key
        def _fake_mode_active() -> bool:
            return False
    # torch.compile must not trace into the staging code (symbolic shapes, raw pointers): a call
    # through this is a graph break, and the staging runs eagerly on the real tensors. Lazy: it
    # imports torch._dynamo only when first used, which is while Dynamo is tracing anyway.
    _outside_graph = _torch._disable_dynamo(_call)
    try:  # the C++ forward wrappers' test for "Dynamo would trace a frame started now"
        _DYNAMO = (_torch._C._dynamo.eval_frame.get_eval_frame_callback, _outside_graph)
    except AttributeError:  # pragma: no cover - a torch without it: every fallback call goes around Dynamo
        _DYNAMO = (lambda: True, _outside_graph)
else:  # pragma: no cover - without torch nothing is compiled
    def _is_compiling() -> bool:
        return False

    _is_exporting = _fake_mode_active = _is_compiling

    _outside_graph = _call
    _DYNAMO = None


_GRAPH_TOKENS: dict = {}  # Dumper._graph_token: token -> (weakref to the Dumper, name)
_GRAPH_TOKEN_COUNT = __import__("itertools").count()


def _no_graph_breaks(token: int) -> bool:
    """Called by a wrapper Dynamo is tracing: True when the graph may not break (fullgraph=True),
    so the wrapper must not stage (each staging call is a graph break). Dynamo runs it once, while
    tracing, and compiles its answer in as a constant (``_dynamo_marked_constant``, what
    ``torch._dynamo.assume_constant_result`` sets, without importing torch._dynamo here)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        strict = bool(tx is not None and (tx.one_graph or getattr(tx, "error_on_graph_break", False)))
    except Exception:  # a torch without these: as before (a fullgraph compile fails at our graph break)
        return False
    if strict:
        dumper, name = _GRAPH_TOKENS.get(token, (lambda: None, None))
        dumper = dumper()
        if dumper is not None and not dumper._closed:
            dumper._traced_without_graph_breaks(name)
    return strict


_no_graph_breaks._dynamo_marked_constant = True


_RENUMBERING_FOLLOWERS: "weakref.WeakSet[Dumper]" = weakref.WeakSet()  # Dumpers following registrations


def _module_paths(model) -> "weakref.WeakKeyDictionary":
    """Each module of ``model`` -> its (first) name (Dumper._paths)."""
    paths = weakref.WeakKeyDictionary()
    for name, module in named_modules(model):
        try:
            paths.setdefault(module, name)
        except TypeError:  # unhashable (__eq__ without __hash__): its registrations go unseen
            pass
    return paths


def _places(model) -> "collections.defaultdict":
    """id of each module of ``model`` -> every name the model holds it under, in walk order (the
    first is the name ``named_modules`` gives it, as at attach)."""
    places = collections.defaultdict(list)
    for path, module in named_modules(model, remove_duplicate=False):
        places[id(module)].append(path)
    return places


def _at_or_under(path: str, name: str) -> bool:
    """``path`` is the module name ``name`` or a name inside it (``layers.1.mlp`` in ``layers.1``,
    never in ``layers.10``)."""
    return path == name or path.startswith(name + ".")


def _moves_within(old, new, prefix: str) -> dict:
    """Old name -> new name of each module under ``old`` that ``new``, taking its place ``prefix``,
    holds at another path (each module by its first path, as at attach)."""
    join = (lambda path: f"{prefix}.{path}" if path else prefix) if prefix else (lambda path: path)
    now = _places(new)
    moves = {}
    for path, sub in named_modules(old):
        if path and id(sub) in now and now[id(sub)][0] != path:
            moves[join(path)] = join(now[id(sub)][0])
    return moves


def _follow_renumbering(dumper) -> None:
    """Have ``dumper`` told of the edits torch's registration hook does not see: the ``insert`` and
    ``__delitem__`` (``del``, ``pop``) of ModuleList and Sequential and the ``__delitem__`` (``del``,
    ``pop``) and ``clear`` of ModuleDict write their ``_modules`` directly, as ``Module.__delattr__``
    does. These class methods are replaced once per process by ones that call the original, then
    tell each Dumper following (Dumper._renumbered); with none, only the call. (A direct write to
    ``_modules`` cannot be followed: the check at close finds it, _not_followed.)"""
    _RENUMBERING_FOLLOWERS.add(dumper)
    for cls, names in ((_torch.nn.ModuleList, ("insert", "__delitem__")), (_torch.nn.Sequential, ("insert", "__delitem__")),
                       (_torch.nn.ModuleDict, ("__delitem__", "clear"))):
        for name in names:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "__fastdump_renumbering__", False):
                setattr(cls, name, _telling_followers(method))
    delattr_ = _torch.nn.Module.__dict__.get("__delattr__")
    if delattr_ is not None and not getattr(delattr_, "__fastdump_renumbering__", False):
        _torch.nn.Module.__delattr__ = _telling_followers(delattr_, only_modules=True)


def _telling_followers(method, only_modules: bool = False):
    """``method`` of a module class, then each following Dumper told what it did to ``_modules``.
    ``only_modules``: ``__delattr__``, whose deletes of anything but a submodule (every ``del
    module.attr`` in the process) pass straight through, after one dict lookup."""
    @functools.wraps(method)
    def renumbering(container, *args, **kwargs):
        if only_modules:
            modules = container.__dict__.get("_modules")
            if not args or not isinstance(modules, dict) or args[0] not in modules:
                return method(container, *args, **kwargs)
        followers = [d for d in list(_RENUMBERING_FOLLOWERS) if not d._closed]
        if not followers:
            return method(container, *args, **kwargs)
        before = dict(container._modules)
        result = method(container, *args, **kwargs)
        for dumper in followers:
            try:
                with dumper._lock:  # (as the registration hook: not while close() takes wrappers off)
                    if not dumper._closed:
                        dumper._renumbered(container, before)
            except Exception as exc:  # never into the model: said
                log.warning("fastdump: %s: renumbering %s after attach: %s: %s", dumper.dir,
                            type(container).__name__, type(exc).__name__, _short(exc))
        return result

    renumbering.__fastdump_renumbering__ = True
    return renumbering


def _wraps(forward):
    """functools.wraps without our own markers: it copies ``__dict__``, and a wrapper made over a
    stale fastdump wrapper must not inherit its ``__fastdump_off__`` or ``__fastdump_previous__``."""
    def decorate(wrapper):
        functools.wraps(forward)(wrapper)
        wrapper.__dict__.pop("__fastdump_off__", None)
        wrapper.__dict__.pop("__fastdump_previous__", None)
        wrapper.__dict__.pop("__fastdump_name__", None)
        return wrapper

    return decorate


def _is_dtensor(value) -> bool:
    """A torch.distributed DTensor: a wrapper without storage of its own, whose data is its local
    shard (``to_local()``, no communication). Imported only when a tensor by that name shows up."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - a torch without torch.distributed
        return False
    return isinstance(value, DTensor)


def _in_a_transform(value) -> bool:
    """A tensor torch.func made inside a transform (vmap's batched tensor, grad's and jvp's
    wrappers, functionalize's): its TensorImpl holds no data, only the level's wrapped value."""
    try:
        return isinstance(value, _Tensor) and _torch._C._functorch.is_functorch_wrapped_tensor(value)
    except Exception:  # (a torch without functorch; a subclass that refuses)
        return False


def _is_async_collective(value) -> bool:
    """A functional collective's result (``torch.distributed._functional_collectives``: what
    torch-native tensor parallelism and a DTensor's ``to_local()`` after a redistribute return): a
    wrapper without storage whose data is the collective's output once waited for. Waiting is what
    the tensor's first use does anyway (on CUDA the current stream waits for the collective's, no
    host synchronisation), so the dump is the value the next module receives."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except Exception:  # pragma: no cover - a torch without torch.distributed
        return False
    return isinstance(value, AsyncCollectiveTensor)


def _owner_of(module):
    """``module`` when its forward is its class's (no instance forward set): the wrappers then follow
    the class's forward as attribute lookup does, so a class patched after attach (a library's
    kernels applied to a built model) runs patched with dumping on, as it does without. Else None."""
    if "forward" in module.__dict__:
        return None
    bound = module.forward
    if (type(bound) is not types.MethodType or bound.__self__ is not module
            or bound.__func__ is not getattr(type(module), "forward", None)):
        return None
    return module


def _check_root_name(model, root_name: str) -> None:
    """root_name= must not be, or lie under, a module's qualified name: the root's output and that
    module's share the name (root_name="lm_head" dumped the root as ``lm_head`` and the LM head as
    ``lm_head#1``, as if called twice), or one's parts skip the other's (``model.final.0``)."""
    clash = [name for name, _ in named_modules(model) if name and _at_or_under(root_name, name)]
    if clash:  # (the deepest one named: parents come first)
        raise ValueError(f"fastdump.attach: root_name={root_name!r} reads as the model's module {clash[-1]!r}: "
                         "its output and that module's would share names; choose another root_name")


_call_name = _fmt.call_name


def _following(owner, forward):
    """``forward``, or for an owner (_owner_of) a callable that calls the owner's class forward as
    attribute lookup finds it at each call (the Python wrappers' twin of ForwardWrapper's owner)."""
    if owner is None:
        return forward

    # What `cls.forward` last gave as a plain function, and whether the class attribute behind it
    # is a staticmethod (which `cls.forward` unwraps to the same plain function): found in the MRO
    # only when the class or its forward changes, not at every call.
    seen = [None, None, False]  # [cls, function, static]

    def class_forward(*args, **kwargs):
        cls = type(owner)  # (at call time: some libraries swap a module's __class__, FSDP2 does)
        f = cls.forward
        if type(f) is types.FunctionType:
            if seen[0] is not cls or seen[1] is not f:
                seen[:] = [cls, f, isinstance(inspect.getattr_static(cls, "forward", None), staticmethod)]
            return f(*args, **kwargs) if seen[2] else f(owner, *args, **kwargs)
        get = getattr(type(f), "__get__", None)
        return (f if get is None else get(f, owner, cls))(*args, **kwargs)

    return class_forward


# Every wrapper a Dumper put on a module, weakly: "ours" is decided by identity, since
# functools.wraps copies a wrapper's __dict__ (our marks included) into whatever wraps it.
_OURS = weakref.WeakSet()


def _mark_ours(wrapper, previous) -> None:
    """Remember what ``wrapper`` wraps: the module's instance forward before it (_MISSING: none)."""
    wrapper.__fastdump_previous__ = previous
    _OURS.add(wrapper)


def _is_ours(forward) -> bool:
    try:
        return forward in _OURS
    except TypeError:  # (an unhashable callable someone put there)
        return False


def _wrapped_by(forward):
    """What our wrapper ``forward`` wraps (_MISSING: the class's forward)."""
    return forward.__dict__.get("__fastdump_previous__", _MISSING)


def _put_back(module, wrapper) -> None:
    """Take ``wrapper``, ours and ``module``'s forward now, off: what it wraps goes back (the
    pass-through wrappers of Dumpers closed earlier skipped, _skip_stale), or nothing where the
    module had no forward of its own."""
    previous = _skip_stale(_wrapped_by(wrapper))
    if previous is _MISSING:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = previous


def _skip_stale(forward):
    """What a closing Dumper puts back: ``forward``, or, when that is the pass-through wrapper of a
    Dumper closed earlier (attach A, attach B, close A, close B), what that wrapper wrapped. Without
    this, every such attach/close cycle left one more dead wrapper on the module (and kept its closed
    Dumper alive through it)."""
    while _is_ours(forward) and forward.__dict__.get("__fastdump_off__"):
        forward = _wrapped_by(forward)
    return forward


def _deepcopy_undumped(module, memo):
    """``copy.deepcopy`` of a module a Dumper wraps (installed as the instance's ``__deepcopy__``).

    A wrapper calls the forward bound to the module it was made for, and deepcopy copies functions
    as they are: the copy would run the original module, with the original's weights, and go on
    doing so after the Dumper closed. So the copy is made without our wrappers: it gets what they
    wrap (the class's forward, or the instance forward someone set before us) and is not dumped."""
    # A module reduces to (cls, args, its __dict__) through object.__reduce_ex__, or to (cls, args)
    # through a __reduce__ of its own (OptimizedModule); other forms are refused, loudly.
    reduced = type(module).__reduce_ex__(module, 4)
    state = reduced[2] if len(reduced) > 2 else None
    if any(x is not None for x in reduced[3:]) or not (state is None or isinstance(state, dict)):
        raise TypeError(f"fastdump: cannot deep-copy {type(module).__name__} while a Dumper wraps it "
                        "(close the Dumper first)")
    copied = reduced[0](*copy.deepcopy(reduced[1], memo))
    memo[id(module)] = copied
    if state is not None:
        state = dict(state)
        _undumped_state(state)
        state = copy.deepcopy(state, memo)
        if hasattr(copied, "__setstate__"):  # nn.Module's; watch() also takes other objects
            copied.__setstate__(state)
        else:
            copied.__dict__.update(state)
    return copied


def _replicate_undumped(module):
    """``nn.Module._replicate_for_data_parallel`` of a module a Dumper wraps (installed on the
    instance, as ``__deepcopy__`` is). DataParallel's replicate() gives each replica a copy of the
    module's ``__dict__``, our wrapper included, which calls the forward of the module it was made
    for: every replica computed with the original's weights, on the original's device. A replica
    gets what our wrappers wrap instead and is not dumped: DataParallel runs its replicas in one
    thread per device at once, and their calls in one pass would be mixed (docs/INTERNALS.md)."""
    replica = type(module)._replicate_for_data_parallel(module)
    _undumped_state(replica.__dict__)
    return replica


def _getstate_undumped(module):
    """``__getstate__`` of a module a Dumper wraps (installed on the instance, as ``__deepcopy__`` is):
    what ``pickle`` and ``torch.save`` store. Our wrappers cannot be pickled (the C one is no Python
    function, the Python ones are closures), so pickling a wrapped model raised; and a wrapper that
    could be would call the forward of the module it was made for. The state stored is the module's
    without our wrappers and copiers, so what is loaded back is a model nothing dumps."""
    getstate = getattr(type(module), "__getstate__", None)  # nn.Module's (object's from Python 3.11)
    state = module.__dict__ if getstate is None else getstate(module)
    if not isinstance(state, dict):
        raise TypeError(f"fastdump: cannot pickle {type(module).__name__} while a Dumper wraps it "
                        "(close the Dumper first)")
    state = dict(state)
    _undumped_state(state)
    return state


_COPIERS = {"__deepcopy__": _deepcopy_undumped, "_replicate_for_data_parallel": _replicate_undumped,
            "__getstate__": _getstate_undumped}


def _undumped_state(state: dict) -> None:
    """A copy of a wrapped module's ``__dict__``, made the state of a module nothing dumps: our
    wrappers give way to what they wrap (the class's forward, or an instance forward set before
    us), and our copiers go."""
    for attr, copier in _COPIERS.items():
        if getattr(state.get(attr), "__func__", None) is copier:
            del state[attr]
    forward = state.pop("forward", _MISSING)
    while _is_ours(forward):
        forward = _wrapped_by(forward)
    if forward is not _MISSING:
        state["forward"] = forward


def _install_copier(module) -> None:
    """Give ``module`` our copiers: _deepcopy_undumped unless it or its class has a ``__deepcopy__``
    of its own; _replicate_undumped when its class replicates for DataParallel (every nn.Module);
    _getstate_undumped (pickle), which wraps the class's ``__getstate__``."""
    cls, own = type(module), module.__dict__
    if "__deepcopy__" not in own and getattr(cls, "__deepcopy__", None) is None:
        own["__deepcopy__"] = types.MethodType(_deepcopy_undumped, module)
    if "_replicate_for_data_parallel" not in own and callable(getattr(cls, "_replicate_for_data_parallel", None)):
        own["_replicate_for_data_parallel"] = types.MethodType(_replicate_undumped, module)
    if "__getstate__" not in own:
        own["__getstate__"] = types.MethodType(_getstate_undumped, module)


def _remove_copier(module) -> None:
    for attr, copier in _COPIERS.items():
        if getattr(module.__dict__.get(attr), "__func__", None) is copier:
            del module.__dict__[attr]


def _is_dataclass_instance(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _structure_of(value):
    """({part path: container kind}, whether it holds a tensor) of an output: path "" is the output,
    ".k" its part k (the suffix its stored names get), kind "tuple", "list", "dict" or
    "dataclass", with ":empty" when that container holds no tensor or array at any depth. kinds
    None: nothing the stored names do not already say (no container holding no tensor, no dict
    with a key like "0"). Cycles and depth are cut as _emit cuts them."""
    kinds: dict = {}
    digit_keys = [False]  # a dict whose key reads like an element index ("0")

    def walk(item, path: str, outer: tuple) -> bool:
        if isinstance(item, _Tensor) or hasattr(item, "__cuda_array_interface__") or hasattr(item, "__dlpack__"):
            return True
        if isinstance(item, (tuple, list)):
            kind, parts = ("tuple" if isinstance(item, tuple) else "list"), enumerate(item)
        elif isinstance(item, dict):
            kind, parts = "dict", item.items()
            digit_keys[0] = digit_keys[0] or any(str(key).isdecimal() for key in item)
        elif _is_dataclass_instance(item):
            kind, parts = "dataclass", ((f.name, _MISSING) for f in dataclasses.fields(item))
        else:
            return False
        if id(item) in outer or len(outer) >= _MAX_NESTING:
            return False
        kinds[path] = kind
        outer = outer + (id(item),)
        held = False
        for key, part in parts:
            try:
                held = walk(getattr(item, key) if part is _MISSING else part, f"{path}.{key}", outer) or held
            except Exception:  # (a field that cannot be read: _emit records it)
                pass
        if not held:
            kinds[path] = kind + ":empty"
        return held

    held = walk(value, "", ())
    # Only what names cannot tell is recorded: a container holding no tensor, a dict whose keys read
    # as element indices. Any other output (an HF ModelOutput, a dict of named tensors) records
    # nothing, so its pass keeps the C pass end.
    untold = any(kind.endswith(":empty") for kind in kinds.values()) or digit_keys[0]
    return (kinds if untold else None), held


def _placed(structure: dict, staged_at: dict, staged: int) -> dict:
    """The pass's structure record with each output that stored nothing placed: ``after``, the
    tensors the pass stored after it returned (``staged``: tensors staged by now), which reads the
    same whatever the Dumper staged before the pass."""
    return {name: (dict(entry, after=staged - staged_at[name]) if name in staged_at else entry)
            for name, entry in structure.items()}


def _on_stack(frame, start) -> bool:
    """Whether ``frame`` is still running: ``start`` or one of its callers."""
    while start is not None:
        if start is frame:
            return True
        start = start.f_back
    return False


def _short(exc: BaseException, limit: int = 200) -> str:
    """An exception's text for a record, shortened; never raises (a model's exception whose str()
    fails must still reach the caller as itself)."""
    try:
        text = str(exc)
    except Exception as inner:
        text = f"<its str() raised {type(inner).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _short_repr(value, limit: int = 80) -> str:
    """repr() of a value for a record, shortened; never raises."""
    try:
        text = repr(value)
    except Exception as inner:
        text = f"<{type(value).__name__} whose repr() raised {type(inner).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _raised_in_a_signal_handler(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by (or under) a Python signal handler the process installed: a
    frame of its traceback runs a handler's code. Attach waits for the writer in slices that return
    to Python so that signals get through; an exception a handler raises there (a deadline's
    SIGALRM raising TimeoutError) is the caller's control flow, not a failure to start dumping."""
    handlers = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            handlers.add(code)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


_MAX_META_INT_BITS = 2000  # ~600 digits: under the lowest limit Python lets json.dumps print (640)


def _jsonable(value, outer: tuple = ()):
    """Pass metadata as JSON: tensors and numpy values become lists (complex ones as [real, imag]
    pairs), enum members their name, other objects their str(); a container inside itself or
    deeper than _MAX_NESTING is cut there (never a RecursionError into the model). Every value it
    returns is one json.dumps takes: a pass's end must never raise into the model."""
    if isinstance(value, (dict, list, tuple)):
        if id(value) in outer:
            return "<cut: refers to itself>"
        if len(outer) >= _MAX_NESTING:
            return f"<cut: nested more than {_MAX_NESTING} deep>"
        outer = outer + (id(value),)
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                key = k if isinstance(k, str) else str(k)
                if key in out:  # keys that read alike (1 and "1"): the later one under its repr, not lost
                    key, n = repr(k), 1
                    while key in out:
                        key, n = f"{k!r}#{n}", n + 1
                out[key] = _jsonable(v, outer)
            return out
        return [_jsonable(v, outer) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_META_INT_BITS:
        return f"<int of {value.bit_length()} bits>"  # json.dumps refuses ints of over 4300 digits (or fewer)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, complex):
        return [value.real, value.imag]
    if isinstance(value, _Tensor):
        if value.numel() > 4096:
            return f"<tensor {tuple(value.shape)}>"
        value = value.detach().cpu()
        return (_torch.view_as_real(value) if value.is_complex() else value).tolist()  # bools, ints, floats
    if isinstance(value, enum.Enum):  # e.g. an engine's ForwardMode.DECODE: its name, not "ForwardMode.DECODE"
        return value.name
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # arrays and scalars
        return _jsonable(value.tolist(), outer) if getattr(value, "size", 1) <= 4096 else \
            f"<array {tuple(value.shape)}>"
    return str(value)



