"""Capture and emit: a call's number in its pass (``name#k``), the names of a value's parts,
handing each tensor or array to the staging channel (the hot path first), and what a
staging status means: counted, dropped or skipped with the reason.

``EmitMixin``'s methods are the Dumper's (fastdump/capture/dumper.py): one ``self``, the
attributes Dumper.__init__ sets; see docs/INTERNALS.md.
"""

from __future__ import annotations

import dataclasses

from .. import _C, dtypes as _dtypes, protocol, format as _fmt
from ..staging import channel as _channel_mod
from .structure import _MAX_NESTING, _MISSING, _is_dataclass_instance, _structure_of
from .tensors import (_FAST_CODES, _Tensor, _check_storage, _in_a_transform, _is_async_collective, _is_dtensor,
                      _resolve_lazy_bits, _strided, _torch, _true_facts, _true_is_nested, _true_nbytes)
from .text import _short, _short_repr


class EmitMixin:
    """The Dumper's capture path: call numbers, names, staging, skips and counts."""

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
            self._channel.lane.add_sent(self.pass_id)  # (stage_tensor counts its own: the pass end's count)
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
        elif self._channel is not None and self._channel.failed:  # DISABLED: the writer stopped writing this root
            self._disable(self._channel_failure())
        else:
            self._disable(self._engine.error())

    def _skip(self, name: str, reason: str) -> None:
        if name not in self._skipped:
            self._skipped[name] = reason
            self._totals["skipped"] += 1

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


_CAPTURING = _C.CAPTURING
_UNSUPPORTED_DEVICE = _channel_mod.UNSUPPORTED_DEVICE  # CudaStager.stage: the producer stream is being captured
_STAGED = _C.STAGED
_NOT_FAST = _C.ChannelStager.NOT_FAST  # ChannelStager.stage_tensor: take the general path


_call_name = _fmt.call_name
