"""Capture: which modules are dumped, what their tensors are called, where passes begin and end.

Each selected module gets an instance-level ``forward`` wrapper instead of a forward hook: the
wrapper runs whether the model calls ``module(x)`` or ``module.forward(x)`` (engine models do the
latter, and hook-based dumpers then silently write nothing). The wrapper hands each tensor to the
staging engine, which copies it (CPU) or snapshots it on the producer stream (CUDA) before
returning, so later in-place kernels cannot change what is dumped.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from .. import _C, format as _fmt
from ..options import (Options, check_meta_keys as _check_meta_keys, check_runtime_env as _check_runtime_env,
                       warn_unknown_env_once)
from .manifest import (cuda_index as _cuda_index, device_facts as _device_facts, write_manifest as _write_manifest,
                       write_role_marker as _write_role_marker, write_session_marker as _write_session_marker)
from .selection import (named_modules, original as _original_module, forward_shadowed as _forward_shadowed,
                        is_script_module as _is_script_module, shared_left_out as _shared_left_out,
                        unwrappable_modules as _unwrappable_modules)
from ..staging import engine as _engine, graphs as _graphs
from ..staging.engine import Engine
from ..fsutil import DirAnchor
from .closing import ClosingMixin
from .compiled import _DYNAMO
from .emit import EmitMixin
from .following import FollowingMixin, _at_or_under
from .outside_passes import OutsidePassesMixin
from .passes import PassesMixin
from .process import _open_dumpers
from .tensors import _FAST_CODES, _TensorType, _strided
from .text import _short
from .wrappers import WrappersMixin, _owner_of

# What fastdump.capture, benchmarks and tests import from here
from .ranks import resolve_ranks  # noqa: F401
from .process import close_all  # noqa: F401
from .forward_slot import _is_ours  # noqa: F401

log = logging.getLogger("fastdump")


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


class Dumper(PassesMixin, EmitMixin, WrappersMixin, FollowingMixin, OutsidePassesMixin, ClosingMixin):
    """Dumps one role/rank of one model: one session, one rank directory. Made by
    :func:`fastdump.attach`; a context manager whose exit is ``close()``.

    Passes: each root forward is one (``root_passes=True``), or ``begin_pass()``/``end_pass()``
    and ``with manual_pass(**meta)``; ``set_pass_meta(**meta)`` adds facts to the current pass.
    ``dump(name, value)`` stores a value no module returns, ``watch(module, name)`` captures one
    more module. ``stats()`` counts what was dumped, dropped and skipped; ``not_wrapped`` names the
    modules fastdump could not wrap, with the reason. Nothing here raises into the model's forward:
    what cannot be stored is a recorded skip, a failure of dumping is logged and recorded and the
    model serves on.
    

    Its methods, one module per job (fastdump/capture/, docs/INTERNALS.md): here attach and the
    public API; ``passes`` (begin/end, nesting, late ends), ``emit`` (naming, staging, skips,
    counts), ``wrappers`` (the forward wrappers), ``following`` (installing them, following module
    edits), ``outside_passes`` (lazy results, EAGLE suspension), ``closing`` (close, failure).
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
        self._close_began = False  # close() got to its channel's close
        self._close_resumes = False  # close() was interrupted where the next close() can finish it
        self._close_seq = 0  # the seq of this Dumper's `close` record once it is in the ring
        self._close_steps: set = set()  # steps of the channel's close that must not run twice, once done
        self._close_step = None  # the step of those running now (cut inside it, a close cannot be finished)
        self._close_cut = None  # what an interrupted close recorded (its error), until a retry finishes it
        self._engine_holder = object()  # this Dumper's token in Engine.acquire / release
        self._engine_unstopped = None  # the engine whose shutdown a Ctrl-C cut in this close()
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
            _write_manifest(self.root, config, role, self.dir.name)  # (the config sent with its channel's open)
            self._engine = Engine.acquire(o.engine, self._engine_holder, o.block_timeout_s)
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

    def begin_pass(self, **meta) -> None:
        """Start a pass by hand (nests: only the outermost begin/end pair counts).

        The pass lasts until the matching ``end_pass()``, across any number of root forwards, as
        long as the function that called ``begin_pass()`` is running. Once that function has
        returned without ``end_pass()``, or when the same ``begin_pass()`` call runs again, the pass
        is dangling: it is closed (recorded incomplete, logged) at the next root forward or
        ``begin_pass()``, which start a pass of their own."""
        _check_meta_keys("begin_pass", meta)
        self._begin_manual(meta, sys._getframe(1))

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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _say_once(self, key: str, fmt: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(fmt, *args)


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


def _check_root_name(model, root_name: str) -> None:
    """root_name= must not be, or lie under, a module's qualified name: the root's output and that
    module's share the name (root_name="lm_head" dumped the root as ``lm_head`` and the LM head as
    ``lm_head#1``, as if called twice), or one's parts skip the other's (``model.final.0``)."""
    clash = [name for name, _ in named_modules(model) if name and _at_or_under(root_name, name)]
    if clash:  # (the deepest one named: parents come first)
        raise ValueError(f"fastdump.attach: root_name={root_name!r} reads as the model's module {clash[-1]!r}: "
                         "its output and that module's would share names; choose another root_name")


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
