"""The per-module forward wrapper: the C++ one (_C.ForwardWrapper, csrc/forward_wrapper.cpp) and the
Python one it falls back to (hooks, torch.compile) dump the same names and bits; both are tested."""

import copy
import gc
import inspect
import os
import signal
import time
import weakref

import pytest
import torch
from torch import nn

import fastdump
from fastdump import _C
from fastdump.capture import following as following_mod

from conftest import open_fds_where, same_bits
from toy_models import Chain


def wrapper_type(kind):
    return _C.ForwardWrapper if kind == "native" else type(lambda: None)


class Norm(nn.Module):
    """RMSNorm(x, residual) style: a tuple out, and it overwrites its input in place afterwards."""

    def forward(self, x, residual=None):
        """Norm's own docstring."""
        if residual is None:
            return x * 2
        residual.add_(x)
        return residual * 0.5, residual


class Rotary(nn.Module):
    def forward(self, q, k):
        return q.sin(), None, k.cos()  # None elements are skipped, the numbering keeps their place


class Heads(nn.Module):
    def forward(self, x):
        return [x + 1, x.t(), x[:, :2]]  # a list; a transposed view and a slice (not contiguous)


class Odd(nn.Module):
    def forward(self, x):
        # A complex tensor (the general path), a Parameter (not an exact tensor), an int, a nested tuple.
        return x.to(torch.complex64) * 1j, nn.Parameter(x * 3, requires_grad=False), 7, (x - 1,)


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            raise ValueError("boom from the model")
        return x - 3


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)
        self.norm = Norm()
        self.rot = Rotary()
        self.heads = Heads()
        self.odd = Odd()
        self.late = nn.Linear(6, 6)
        self.boom = Boom()
        self.use_late = False
        self.seen = []  # (name, value) as each module returned, cloned

    def keep(self, name, value):
        self.seen.append((name, value.clone()))

    def forward(self, x):
        seen = self.seen
        seen.clear()
        h = self.lin(x)
        self.keep("lin", h)
        res = x.clone()
        normed, res = self.norm(h, res)
        self.keep("norm.0", normed)
        self.keep("norm.1", res)
        q, none, k = self.rot(normed, res)
        assert none is None
        self.keep("rot.0", q)
        self.keep("rot.2", k)
        normed2, res = self.norm(q, res)  # second call of one module: norm#1.0, norm#1.1
        self.keep("norm#1.0", normed2)
        self.keep("norm#1.1", res)
        heads = self.heads(normed2)
        for i, t in enumerate(heads):
            self.keep(f"heads.{i}", t)
        z, p, _, (w,) = self.odd(heads[0])
        self.keep("odd.0", z)
        self.keep("odd.1", p.data)
        self.keep("odd.3.0", w)
        out = self.norm(heads[0])  # a third call, a plain tensor: norm#2
        self.keep("norm#2", out)
        if self.use_late:  # a module first called mid-run: a new name
            out = self.late(out)
            self.keep("late", out)
        out = self.boom(out)
        self.keep("boom", out)
        return out


def run(model, d, passes, late_from=None):
    reference = []
    with torch.inference_mode():
        for i in range(passes):
            model.use_late = late_from is not None and i >= late_from
            model(torch.randn(4, 6))
            reference.append(list(model.seen))
    return reference


def check(tmp_path, reference, role="target", root="Model"):
    ds = fastdump.open(tmp_path)
    assert ds.passes(role, 0) == list(range(len(reference)))
    for pass_id, want in enumerate(reference):
        dumped = ds.load(role, 0, pass_id)
        names = [n for n in dumped if n != root]
        assert names == [n for n, _ in want], pass_id
        for name, value in want:
            assert same_bits(dumped[name], value), (pass_id, name)
    return ds


def test_every_output_shape_is_dumped_bit_exact_under_its_name(tmp_path, kind):
    model = Model()
    d = fastdump.attach(model, tmp_path)
    assert type(model.lin.forward) is wrapper_type(kind) and type(model.norm.forward) is wrapper_type(kind)
    reference = run(model, d, passes=4, late_from=2)
    stats = d.close()
    assert stats["status"] == "closed" and stats["passes"] == 4
    assert stats["skipped"] == 0  # odd.2, the int: not tensor data, as before
    check(tmp_path, reference)
    # The fast path and the fallbacks count what they staged alike.
    assert stats["tensors"] == sum(len(p) + 1 for p in reference)  # + the root's output


def test_inputs_are_dumped_before_forward_changes_them(tmp_path, kind):
    model = Model()
    d = fastdump.attach(model, tmp_path, inputs=True, include="^norm$")
    x = torch.randn(4, 6)
    with torch.inference_mode():
        h = model.lin(x)
        res = x.clone()
        model(x)
    d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert same_bits(dumped["norm.input.0"], h)
    assert same_bits(dumped["norm.input.1"], res)  # before norm's residual.add_
    assert "norm#1.input.0" in dumped and "norm#2.input.0" in dumped and "norm#2" in dumped


def test_a_stalled_writer_under_drop_drops_whole_passes_and_counts_them(tmp_path, kind):
    model = Model()
    d = fastdump.attach(model, tmp_path, ring_mb=1, policy="drop")
    reference = run(model, d, passes=1)
    dropped_ids = []
    os.kill(d._engine._proc.pid, signal.SIGSTOP)  # the writer stalls: the ring fills
    try:
        with torch.inference_mode():
            for i in range(40):  # 64 KiB each, 2.5 MiB in all: more than the ring
                d.dump(f"filler{i}", torch.full((16384,), float(i)))
            for _ in range(3000):  # until 3 find no room for their pass start: dropped whole
                before = d.stats()["dropped_passes"]
                out = model(torch.randn(4, 6))
                assert same_bits(out, model.seen[-1][1])  # the wrappers passed everything through
                if d.stats()["dropped_passes"] > before:
                    dropped_ids.append(d.pass_id)
                    if len(dropped_ids) == 3:
                        break
            assert len(dropped_ids) == 3
    finally:
        os.kill(d._engine._proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while d._engine.producer.used_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)  # the writer drains the ring: the next pass finds room
    reference.append(run(model, d, passes=1)[0])
    last = d.pass_id
    stats = d.close()
    assert stats["status"] == "closed" and stats["dropped_passes"] >= 3
    ds = fastdump.open(tmp_path)
    passes = ds.passes("target", 0)
    assert not set(dropped_ids) & set(passes)
    for pass_id, want in ((0, reference[0]), (last, reference[1])):  # before and after: whole, bit-exact
        dumped = ds.load("target", 0, pass_id)
        assert [n for n in dumped if n != "Model"] == [n for n, _ in want]
        for name, value in want:
            assert same_bits(dumped[name], value), name


def test_two_dumpers_on_one_model_both_dump_it_and_close_in_any_order(tmp_path, kind):
    model = Model()
    original = model.lin.forward
    first = fastdump.attach(model, tmp_path, role="first")
    second = fastdump.attach(model, tmp_path, role="second")
    reference = run(model, first, passes=2)
    first.close()  # its wrapper sits under the second one's: it becomes a pass-through
    assert model.lin.__dict__["forward"].__wrapped__.__fastdump_off__  # the first one's, under the second's
    reference2 = run(model, second, passes=1)
    second.close()
    # The second one puts back what the first one's pass-through wrapped: no wrapper is left.
    for module in model.modules():
        assert "forward" not in module.__dict__
    assert model.lin.forward == original
    check(tmp_path / "", reference, role="first")
    check(tmp_path, reference + reference2, role="second")


def test_attach_close_cycles_in_attach_order_leave_no_wrapper_and_no_dumper_behind(tmp_path, kind):
    # EAGLE's draft and target share modules (embeddings, LM head); a server that switches dumping
    # on and off closes its Dumpers in the order it attached them. Each cycle used to leave one
    # more dead wrapper on the shared modules, each keeping its closed Dumper alive.
    model = Model()
    closed = []
    for cycle in range(3):
        target = fastdump.attach(model, tmp_path / f"c{cycle}", role="target")
        draft = fastdump.attach(model, tmp_path / f"c{cycle}", role="draft")
        want = run(model, target, passes=1)
        target.close()
        draft.close()
        check(tmp_path / f"c{cycle}", want, role="target")
        check(tmp_path / f"c{cycle}", want, role="draft")
        assert all("forward" not in m.__dict__ for m in model.modules())
        closed += [weakref.ref(target), weakref.ref(draft)]
        del target, draft
    gc.collect()
    assert [r() for r in closed] == [None] * 6


def test_a_foreign_wrapper_over_ours_keeps_ours_as_a_pass_through(tmp_path, kind):
    model = Model()
    original = model.lin.forward
    d = fastdump.attach(model, tmp_path)
    ours = model.lin.forward
    calls = []

    def foreign(*args, **kwargs):  # someone else's wrapper (accelerate's hooks do this)
        calls.append(1)
        return ours(*args, **kwargs)

    model.lin.forward = foreign
    want = run(model, d, passes=1)
    d.close()
    assert model.lin.__dict__["forward"] is foreign  # not ours to remove
    x = torch.randn(4, 6)
    assert same_bits(model.lin.forward(x), original(x)) and len(calls) == 2
    check(tmp_path, want)


def test_close_restores_forward_and_a_kept_wrapper_passes_through(tmp_path, kind):
    model = Model()
    d = fastdump.attach(model, tmp_path)
    kept = model.norm.forward
    run(model, d, passes=1)
    d.close()
    for module in model.modules():
        assert "forward" not in module.__dict__
    x, res = torch.randn(4, 6), torch.randn(4, 6)
    want = Norm()(x, res.clone())
    got = kept(x, res.clone())  # called after its Dumper closed: the original forward, nothing else
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert fastdump.open(tmp_path).passes("target", 0) == [0]


def test_the_wrapper_keeps_the_signature_and_the_wrapped_forward(tmp_path, kind):
    model = Model()
    original = model.norm.forward
    d = fastdump.attach(model, tmp_path)
    try:
        w = model.norm.forward
        assert inspect.signature(w) == inspect.signature(original)
        assert list(inspect.signature(w).parameters) == ["x", "residual"]
        assert w.__wrapped__ == original and inspect.unwrap(w) == original
        assert (w.__name__, w.__qualname__, w.__doc__, w.__module__) == (
            "forward", "Norm.forward", "Norm's own docstring.", __name__)
        assert "__fastdump_off__" not in w.__dict__
    finally:
        d.close()


def test_an_exception_in_forward_reaches_the_caller_and_the_pass_is_incomplete(tmp_path, kind):
    model = Model()
    d = fastdump.attach(model, tmp_path)
    run(model, d, passes=1)
    model.boom.armed = True
    with torch.inference_mode(), pytest.raises(ValueError, match="boom from the model") as raised:
        model(torch.randn(4, 6))
    assert raised.traceback[-1].name == "forward"  # raised by the model's code, unchanged
    model.boom.armed = False
    reference = run(model, d, passes=1)
    stats = d.close()
    assert stats["incomplete_passes"] == 1
    ds = fastdump.open(tmp_path)
    assert [ds.meta("target", 0, p)["complete"] for p in (0, 1, 2)] == [True, False, True]
    assert "ValueError" in ds.meta("target", 0, 1)["incomplete"]
    assert "boom" not in ds.load("target", 0, 1) and "late" not in ds.load("target", 0, 1)
    dumped = ds.load("target", 0, 2)
    for name, value in reference[0]:
        assert same_bits(dumped[name], value), name


def test_a_failing_fallback_is_recorded_never_raised_into_the_model(tmp_path, kind):
    model = Model()
    d = fastdump.attach(model, tmp_path)

    def broken(name, value):
        raise RuntimeError("broken staging")

    d._stage = broken  # every name is new: each one goes through _stage
    with torch.inference_mode():
        out = model(torch.randn(4, 6))
    assert same_bits(out, model.seen[-1][1])
    del d._stage
    reference = run(model, d, passes=1)
    stats = d.close()
    assert stats["skipped"] > 0
    ds = fastdump.open(tmp_path)
    skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, 0)["skipped"]}
    assert "broken staging" in skipped["lin"] and "broken staging" in skipped["heads.0"]  # each element alone
    dumped = ds.load("target", 0, 1)
    for name, value in reference[0]:
        assert same_bits(dumped[name], value), name


def test_a_closed_model_is_freed(tmp_path, kind):
    model = Model()
    d = fastdump.attach(model, tmp_path)
    run(model, d, passes=1)
    d.close()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_the_native_wrapper_ignores_what_it_is_not_given():
    state = _C.CaptureState(object(), {}, {}, torch.Tensor)
    with pytest.raises(TypeError):
        _C.ForwardWrapper(state, "x", 42)
    with pytest.raises(TypeError):
        state.lane = object()  # only a ChannelStager, or None
    w = _C.ForwardWrapper(state, "x", lambda a, b=2: a + b)
    assert w(1) == 3 and w(1, b=5) == 6  # not capturing: the forward's own result
    assert w.__copy__() is w
    assert weakref.ref(w)() is w


def test_a_compiled_submodule_without_a_root_wrapper_switches_to_python_wrappers(tmp_path):
    model = Model()
    d = fastdump.attach(model, tmp_path, root_passes=False)
    assert type(model.lin.forward) is _C.ForwardWrapper
    torch._dynamo.reset()
    compiled = torch.compile(model.heads, backend="eager")
    x = torch.randn(4, 6)
    with torch.no_grad():
        d.begin_pass()
        first = compiled(x)
        d.end_pass()
        d.begin_pass()
        second = compiled(x)
        d.end_pass()
    d.close()
    torch._dynamo.reset()
    assert d._python_wrappers  # the C++ wrapper saw Dynamo's callback set: the Dumper switched
    ds = fastdump.open(tmp_path)
    for pass_id, out in enumerate((first, second)):
        dumped = ds.load("target", 0, pass_id)
        assert list(dumped) == ["heads.0", "heads.1", "heads.2"]
        assert all(same_bits(dumped[f"heads.{i}"], out[i]) for i in range(3))


def test_plain_outputs_are_staged_without_a_python_call(tmp_path):
    """The native wrapper's point: after the first pass gave every name its id, a first call that
    returns a tensor or a tuple/list of tensors reaches no Python method of the Dumper."""
    model = Model()
    d = fastdump.attach(model, tmp_path)
    run(model, d, passes=1)
    called = []
    for method in ("_stage", "_capture", "_fast_status", "_capture_inputs", "_emit_safely", "_capture_failed"):
        real = getattr(d, method)
        setattr(d, method, lambda name, *rest, real=real, method=method: called.append((method, name)) or real(name, *rest))
    reference = run(model, d, passes=1)
    for method in ("_stage", "_capture", "_fast_status", "_capture_inputs", "_emit_safely", "_capture_failed"):
        delattr(d, method)
    d.close()
    # Python only for what the C path leaves to it: later calls (norm#1, norm#2) and the odd output.
    # The root's own plain output goes through the C path too.
    plain = {"lin", "norm", "rot", "heads", "boom", "Model"}
    assert not [c for c in called if c[1].split(".")[0] in plain and c != ("_capture", "norm")], called
    assert called.count(("_capture", "norm")) == 2 and ("_capture", "odd") in called
    dumped = fastdump.open(tmp_path).load("target", 0, 1)
    for name, value in reference[0]:
        assert same_bits(dumped[name], value), name


class Planting(nn.Module):
    """Plants ``bogus`` as lin's call count of the open pass before calling it (and calls it twice)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)
        self.after = nn.Linear(6, 6)
        self.dumper = None
        self.bogus = None

    def forward(self, x):
        if self.bogus is not None:
            self.dumper._calls["lin"] = self.bogus
        h = self.lin(x)
        return self.after(h), self.lin(h)


def test_a_call_count_that_is_not_a_count_is_a_recorded_skip_never_raised(tmp_path):
    """The C wrapper numbers a call from the Dumper's _calls (claim_call): a first call inserts its
    count, a later one reads it; what it reads there that is no count is recorded against the name,
    never raised into the model, and the pass's other tensors are dumped bit-exact."""
    model = Planting()
    d = fastdump.attach(model, tmp_path)
    model.dumper = d
    with torch.inference_mode():
        first = model(torch.randn(4, 6))  # pass 0: lin and lin#1, numbered in C
        model.bogus = "three"
        x = torch.randn(4, 6)
        out = model(x)  # pass 1: lin's count is not a count
    with torch.inference_mode():
        want = model.after(model.lin(x))
    assert same_bits(out[0], want)
    d.close()
    ds = fastdump.open(tmp_path)
    assert sorted(ds.load("target", 0, 0)) == ["Planting.0", "Planting.1", "after", "lin", "lin#1"]
    assert same_bits(ds.load("target", 0, 0)["lin#1"], first[1])
    skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, 1)["skipped"]}
    assert "a call count is not a count" in skipped["lin"], skipped
    dumped = ds.load("target", 0, 1)
    assert "lin" not in dumped and same_bits(dumped["after"], want)


class TupleRoot(nn.Module):
    """A root returning what a causal LM's forward returns: logits and hidden states (and a None)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        return h.softmax(-1), None, h


def test_the_roots_own_tuple_output_and_inputs_are_dumped_bit_exact(tmp_path, kind):
    """The root's output and inputs, each pass: the native kind stages the output without a Python
    call of the Dumper (its inputs take the Python path, as any module's), both kinds alike."""
    model = TupleRoot()
    d = fastdump.attach(model, tmp_path, inputs=True)
    called, seen = [], []
    with torch.inference_mode():
        for i in range(3):
            if i == 1:  # the first pass gave the names their ids
                for method in ("_stage", "_capture", "_fast_status", "_emit_safely", "_capture_failed"):
                    real = getattr(d, method)
                    setattr(d, method, lambda name, *rest, real=real, method=method:
                            called.append((method, name)) or real(name, *rest))
            x = torch.randn(4, 6)
            logits, none, h = model(x)
            assert none is None
            seen.append((x.clone(), logits.clone(), h.clone()))
    stats = d.close()
    assert stats["status"] == "closed" and stats["passes"] == 3 and stats["skipped"] == 0
    ds = fastdump.open(tmp_path)
    for p, (x, logits, h) in enumerate(seen):
        dumped = ds.load("target", 0, p)
        assert same_bits(dumped["TupleRoot.0"], logits) and same_bits(dumped["TupleRoot.2"], h), p
        assert same_bits(dumped["TupleRoot.input.0"], x) and same_bits(dumped["lin"], h), p
        assert "TupleRoot.1" not in dumped  # the None keeps its place in the numbering, nothing dumped
    root_output_calls = [c for c in called if c[1].startswith("TupleRoot") and ".input." not in c[1]]
    if kind == "native":
        assert not root_output_calls, root_output_calls
    else:
        assert ("_capture", "TupleRoot") in root_output_calls


def test_a_deep_copy_of_a_dumped_model_computes_with_its_own_weights_and_is_not_dumped(tmp_path, kind):
    # A wrapper calls the forward bound to the module it was made for, and deepcopy keeps functions
    # as they are: the copy ran the original modules, with the original's weights, even after close.
    model = Model()
    d = fastdump.attach(model, tmp_path)
    want = run(model, d, passes=1)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    for module in twin.modules():  # what our wrappers wrapped: the class's forward, not dumped
        assert "forward" not in module.__dict__ and "__deepcopy__" not in module.__dict__
    reference, original = Model(), Model()  # unwrapped, with the copy's and the original's weights
    reference.load_state_dict(twin.state_dict())
    original.load_state_dict(model.state_dict())
    x = torch.randn(4, 6)
    with torch.inference_mode():
        got = twin(x)
        assert same_bits(got, reference(x)) and not same_bits(got, original(x))
    want += run(model, d, passes=1)  # the original still dumps, pass 1 after the copy's forward
    d.close()
    for module in model.modules():
        assert "forward" not in module.__dict__ and "__deepcopy__" not in module.__dict__
    check(tmp_path, want)  # passes 0 and 1 only: the copy's forward was not dumped


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickled_dumped_model_loads_back_undumped_and_computes_the_same(tmp_path, kind, how):
    # pickle / torch.save(model) of a wrapped model raised (the wrappers cannot be pickled); one
    # that could be pickled would call the original's forward. The loaded copy is a model nothing dumps.
    import io
    import pickle

    model = Model()
    d = fastdump.attach(model, tmp_path)
    want = run(model, d, passes=1)
    if how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    fastdump_attrs = {"forward", "__deepcopy__", "__getstate__", "_replicate_for_data_parallel"}
    for module in twin.modules():
        assert not fastdump_attrs & set(module.__dict__), type(module)
    reference = Model()  # unwrapped, with the same weights
    reference.load_state_dict(model.state_dict())
    for a, b in zip(twin.state_dict().values(), reference.state_dict().values()):
        assert same_bits(a, b)
    x = torch.randn(4, 6)
    with torch.inference_mode():
        assert same_bits(twin(x), reference(x))
    want += run(model, d, passes=1)  # the original still dumps, pass 1 after the copy's forward
    d.close()
    for module in model.modules():
        assert not fastdump_attrs & set(module.__dict__), type(module)
    check(tmp_path, want)  # passes 0 and 1 only: the copy's forward was not dumped


def test_a_module_with_its_own_deepcopy_keeps_it(tmp_path, kind):
    class Custom(nn.Linear):
        def __deepcopy__(self, memo):
            return "custom copy"

    model = nn.Sequential(Custom(3, 3))
    with fastdump.attach(model, tmp_path):
        assert "__deepcopy__" not in model[0].__dict__
        assert copy.deepcopy(model[0]) == "custom copy"


class Layered(nn.Module):
    """model.layers.N, as HF and SGLang name decoder layers (what layers= selects)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return self.head(x)


def test_a_compiled_model_is_dumped_under_its_eager_names(tmp_path):
    # torch.compile(model) is an OptimizedModule whose children sit under "_orig_mod": the names
    # (and layers=) must be the eager model's, or a compiled run cannot be diffed against an eager one.
    x = torch.randn(2, 4)
    eager = Layered()
    with fastdump.attach(eager, tmp_path / "eager", layers=[0, 2]):
        with torch.no_grad():
            want = eager(x)
    model = Layered()
    model.model.layers[1] = torch.compile(model.model.layers[1], backend="eager")  # a compiled submodule
    compiled = torch.compile(model, backend="eager")
    with fastdump.attach(compiled, tmp_path / "compiled", layers=[0, 2]):
        with torch.no_grad():
            got = compiled(x)
    assert same_bits(got, want)
    a = fastdump.open(tmp_path / "eager").load("target", 0, 0)
    b = fastdump.open(tmp_path / "compiled").load("target", 0, 0)
    assert list(a) == ["model.layers.0.0", "model.layers.0.1", "model.layers.2.0", "model.layers.2.1", "head",
                       "Layered"]
    assert list(b) == list(a)
    for name in a:
        assert same_bits(a[name], b[name]), name


def test_a_class_patched_after_attach_runs_patched_and_is_dumped(tmp_path, kind):
    # Libraries patch model classes (kernels, quantization) after the model is built; with the
    # wrapper holding the forward it was bound to at attach, the served model ignored the patch
    # while dumping was on.
    class Scale(nn.Module):
        def forward(self, x):
            return x * 2

    class Sub(Scale):  # inherits Scale.forward
        pass

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.a, self.b = Scale(), Sub()

        def forward(self, x):
            return self.b(self.a(self.lin(x)))

    model = Top()
    x = torch.randn(2, 3)
    served = []
    d = fastdump.attach(model, tmp_path)
    with torch.inference_mode():
        lin = nn.functional.linear(x, model.lin.weight, model.lin.bias)
        served.append(model(x))
        Scale.forward = lambda self, x: x + 100  # a and b (a subclass) both follow
        served.append(model(x))
        Top.unrelated = 1  # a class change that leaves forward alone
        Top.forward = lambda self, x: self.a(x)  # the root's class
        served.append(model(x))
    d.close()
    want = [{"lin": lin, "a": lin * 2, "b": lin * 4, "Top": lin * 4},
            {"lin": lin, "a": lin + 100, "b": (lin + 100) + 100, "Top": (lin + 100) + 100},
            {"a": x + 100, "Top": x + 100}]
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    for pass_id, expected in enumerate(want):
        assert same_bits(served[pass_id], expected["Top"]), pass_id
        dumped = ds.load("target", 0, pass_id)
        assert list(dumped) == list(expected), pass_id
        for name, value in expected.items():
            assert same_bits(dumped[name], value), (pass_id, name)


def test_an_instance_forward_set_before_attach_is_what_runs(tmp_path, kind):
    model = nn.Sequential(nn.Linear(3, 3))
    model[0].forward = lambda x: x - 1  # the instance's own forward, not its class's
    x = torch.randn(2, 3)
    with fastdump.attach(model, tmp_path):
        nn.Linear.forward = nn.Linear.forward  # a class change: the instance forward still wins
        with torch.inference_mode():
            out = model(x)
    assert same_bits(out, x - 1)
    assert same_bits(fastdump.open(tmp_path).load("target", 0, 0)["0"], x - 1)


def test_torch_export_of_a_dumped_model_is_no_pass(tmp_path, kind):
    # torch.export (non-strict, its default) traces the model with fake tensors: nothing runs for
    # real. It used to open a pass of skipped FakeTensors (shifting every later pass id) and switch
    # the leaves to the Python wrappers for good. (Strict export fails at the C wrappers, which
    # Dynamo cannot trace, as it did before: close the Dumper first.)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    d = fastdump.attach(model, tmp_path)
    program = torch.export.export(model, (x,))
    assert d.pass_id == -1 and d.stats()["skipped"] == 0
    if kind == "native":
        assert type(model[0].__dict__["forward"]) is _C.ForwardWrapper
    with torch.inference_mode():
        out = model(x)  # pass 0: the first forward that ran
        first = model[0](x)  # (outside a pass: not dumped)
        assert same_bits(program.module()(x), out)
    d.close()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0]
    dumped = ds.load("target", 0, 0)
    assert list(dumped) == ["0", "1", "2", "Sequential"]
    assert same_bits(dumped["0"], first) and same_bits(dumped["Sequential"], out)


def test_a_module_whose_class_is_swapped_after_attach_runs_its_new_class(tmp_path, kind):
    # Some libraries change a built module's __class__ (FSDP2's fully_shard makes a subclass).
    class Plus(nn.Module):
        def forward(self, x):
            return x + 1

    class Plus1000(Plus):
        def forward(self, x):
            return x + 1000

    model = nn.Sequential(Plus(), nn.Identity())
    x = torch.zeros(2)
    with fastdump.attach(model, tmp_path):
        model[0].__class__ = Plus1000
        with torch.inference_mode():
            out = model(x)
    assert same_bits(out, x + 1000)
    assert same_bits(fastdump.open(tmp_path).load("target", 0, 0)["0"], x + 1000)


def test_a_deep_copy_of_a_dumped_compiled_model_is_its_own_and_not_dumped(tmp_path, kind):
    # torch.compile's OptimizedModule copies itself through __reduce__ (no state dict): the copy
    # must be made from a copy of the original module without our wrappers, as without a Dumper.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(2, 4)
    d = fastdump.attach(compiled, tmp_path)
    with torch.inference_mode():
        out = compiled(x)  # pass 0
    twin = copy.deepcopy(compiled)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
        got = twin(x)
    lin = twin._orig_mod[0]
    assert same_bits(got, nn.functional.relu(nn.functional.linear(x, lin.weight, lin.bias)))
    assert all("forward" not in m.__dict__ and "__deepcopy__" not in m.__dict__ for m in twin._orig_mod.modules())
    d.close()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0]  # the copy's forward was not dumped
    assert same_bits(ds.load("target", 0, 0)["Sequential"], out)


def test_a_compiled_model_with_inputs_numbers_each_call_and_does_not_recompile_per_pass(tmp_path):
    """Under torch.compile with inputs=True a call is numbered when it starts, in the graph break
    that captures its inputs (Dumper._enter_call), and closed by the one that captures its output:
    inputs and output share #k, and no per-pass value flows through the traced frames (which would
    recompile them every pass)."""
    import torch._dynamo

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(self.lin(x)) + 1

    torch._dynamo.reset()
    model = Twice()
    compiled = torch.compile(model, backend="eager")
    xs = [torch.randn(2, 4) for _ in range(4)]
    with fastdump.attach(compiled, tmp_path, inputs=True):
        with torch.no_grad():
            outs = [compiled(x) for x in xs[:2]]
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            outs += [compiled(x) for x in xs[2:]]
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # nothing recompiled
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2, 3]
    for p, (x, out) in enumerate(zip(xs, outs)):
        with torch.no_grad():
            a = model.lin(x)
            b = model.lin(a)
        dumped = ds.load("target", 0, p)
        want = {"lin.input.0": x, "lin": a, "lin#1.input.0": a, "lin#1": b, "Twice.input.0": x, "Twice": out}
        assert sorted(dumped) == sorted(want), (p, list(dumped))
        for name, value in want.items():
            assert same_bits(dumped[name], value), (p, name)


class LoRA(nn.Module):
    """What LoRA and quantization libraries do: a module set in a linear's place, holding it."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.down, self.up = nn.Linear(4, 3, bias=False), nn.Linear(3, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def test_modules_put_into_the_model_after_attach_are_dumped_under_the_names_they_take(tmp_path, kind):
    # A module registered after attach got no wrapper: its outputs were missing from every pass,
    # and verify said OK.
    model = Layered()
    d = fastdump.attach(model, tmp_path, layers=[0, 1])
    torch.manual_seed(2)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model.model.layers[1] = fresh  # ModuleList.__setitem__
    old_head = model.head
    model.head = LoRA(old_head)  # __setattr__; the old head lives on inside it, under its old name
    model.model.layers[2] = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # outside layers=[0, 1]
    x = torch.randn(2, 4)
    with torch.inference_mode():
        out = model(x)
        l0 = model.model.layers[0][0](x)
        h0 = model.model.layers[0][1](l0)
        a = fresh[0](h0)
        b = fresh[1](a)
        h2 = model.model.layers[2](b)
        head, down = old_head(h2), model.head.down(h2)
        up = model.head.up(down)
    d.close()
    assert same_bits(out, head + up)
    for module in model.modules():  # close() took every wrapper off, the adopted ones too
        assert "forward" not in module.__dict__ and "__deepcopy__" not in module.__dict__
    model.model.layers[0] = nn.Linear(4, 4)  # after close: nothing follows registrations any more
    assert "forward" not in model.model.layers[0].__dict__
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    want = {"model.layers.0.0": l0, "model.layers.0.1": h0, "model.layers.1.0": a, "model.layers.1.1": b, "head": head, "head.down": down, "head.up": up,
            "Layered": out}
    assert sorted(dumped) == sorted(want)
    for name, value in want.items():
        assert same_bits(dumped[name], value), name


def _swap_two(layers):
    first = layers[0]
    layers[0] = nn.Linear(4, 4)
    layers[1] = first  # the module of layers.0 at layers.1, a new one at layers.0


MOVES = {
    "del_then_append": lambda layers: (layers.__delitem__(1), layers.append(nn.Linear(4, 4))),
    "swap_two": _swap_two,
    "insert_at_0": lambda layers: layers.insert(0, nn.Linear(4, 4)),
    "insert_in_the_middle": lambda layers: layers.insert(2, nn.Linear(4, 4)),
    "del": lambda layers: layers.__delitem__(1),
    "pop_first": lambda layers: layers.pop(0),
    "del_slice": lambda layers: layers.__delitem__(slice(0, 2)),
    "insert_del_append": lambda layers: (layers.insert(1, nn.Linear(4, 4)), layers.__delitem__(0),
                                         layers.append(nn.Linear(4, 4))),
}


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential])
@pytest.mark.parametrize("move", sorted(MOVES))
def test_modules_renumbered_after_attach_dump_under_their_numbers_now(tmp_path, kind, move, container):
    """``insert`` and ``del`` (``pop``) of a ModuleList or Sequential write its ``_modules``
    directly, which torch's registration hook does not see: an inserted module was never wrapped
    (its output missing), the modules after it dumped under their old numbers, and ``del`` then
    ``append`` put a new ``layers.2`` beside the old one (two modules read as one called twice,
    ``layers.2#1``). verify said OK each time. Each name holds the output of the module the model
    has under it when the pass runs, bit for bit."""
    from fastdump.cli.dump import verify_dump

    model = Chain(4)
    model.layers = container(*model.layers) if container is nn.Sequential else model.layers
    d = fastdump.attach(model, tmp_path)
    torch.manual_seed(4)
    MOVES[move](model.layers)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x)
        want, h = {}, x
        for i, layer in enumerate(model.layers):
            h = want[f"layers.{i}"] = layer(h)
    d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert sorted(dumped) == sorted(list(want) + ["Chain"])
    for name, value in want.items():
        assert same_bits(dumped[name], value), name
    assert same_bits(dumped["Chain"], out)
    assert verify_dump(str(tmp_path)).problems == []


def _shared_at(layers, *positions):
    """``layers`` with its module at ``positions[0]`` held at each of ``positions`` (grown by appends)."""
    for position in positions[1:]:
        while len(layers) < position:
            layers.append(nn.Linear(4, 4))
        layers.insert(position, layers[positions[0]])


SHARED_MOVES = {  # (what the model holds at attach, what is done after): one module held twice
    "insert_it_again": (None, lambda layers: layers.insert(1, layers[0])),
    "insert_before_its_second_place": (lambda layers: _shared_at(layers, 0, 3),
                                       lambda layers: layers.insert(1, nn.Linear(4, 4))),
    "del_between_its_places": (lambda layers: _shared_at(layers, 0, 3), lambda layers: layers.__delitem__(1)),
}


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential])
@pytest.mark.parametrize("move", sorted(SHARED_MOVES))
def test_a_module_held_at_two_numbers_after_a_renumbering_is_named_as_at_attach(tmp_path, move, container):
    """A module held at two numbers is dumped under its first (``layers.0``, then ``layers.0#1``).
    After an ``insert`` or ``del`` that left it at its first number, it was renamed to its second
    (``layers.3``): a dump of the model changed after attach named its tensors otherwise than one
    of the same model attached afterwards, and ``layers.3`` held the output of position 0."""
    before, after = SHARED_MOVES[move]
    model = Chain(3)
    if before is not None:
        before(model.layers)
    model.layers = container(*model.layers) if container is nn.Sequential else model.layers
    x = torch.randn(2, 4)
    dumps = []
    for root in (tmp_path / "changed_after_attach", tmp_path / "attached_after"):
        d = fastdump.attach(model, root)
        if not dumps:
            after(model.layers)
        with torch.no_grad():
            model(x)
        d.close()
        dumps.append(fastdump.open(root).load("target", 0, 0))
    changed, reference = dumps
    assert sorted(changed) == sorted(reference)
    assert "layers.0#1" in reference
    for name, value in reference.items():
        assert same_bits(changed[name], value), name


def test_a_module_put_in_on_another_thread_while_close_runs_is_left_unwrapped(tmp_path, monkeypatch):
    """A registration on another thread that had seen the Dumper open wrapped its module after
    close() had taken the wrappers off: a wrapper and copiers left on the model for good, holding
    the closed Dumper. close() now waits for that wrapping, then takes it off too."""
    import threading

    model = Chain(2)
    d = fastdump.attach(model, tmp_path)
    selecting, go = threading.Event(), threading.Event()
    select = following_mod._select_subtree

    def slow_select(*args, **kwargs):
        selecting.set()
        go.wait(10)
        return select(*args, **kwargs)

    monkeypatch.setattr("fastdump.capture.following._select_subtree", slow_select)
    fresh = nn.Linear(4, 4)
    putter = threading.Thread(target=model.layers.append, args=(fresh,))
    putter.start()
    assert selecting.wait(10)
    closer = threading.Thread(target=d.close)
    closer.start()
    closer.join(0.5)  # (the old code closed here, while the registration still wrapped)
    go.set()
    putter.join(10)
    closer.join(30)
    assert not closer.is_alive() and d.status == "closed"
    for module in model.modules():
        assert "forward" not in module.__dict__ and "__getstate__" not in module.__dict__, module


class TwoPaths(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.keep = nn.Linear(4, 4)

    def forward(self, x):
        x = self.keep(x)
        for name in ("a", "b"):
            if hasattr(self, name):
                x = getattr(self, name)(x)
        return x


@pytest.mark.parametrize("when", ["at_attach", "after_attach"])
def test_a_module_held_under_an_excluded_name_and_a_kept_one_is_left_out_alike(tmp_path, kind, when):
    """One module put in as ``a`` (excluded) and ``b`` (kept) after attach was wrapped as ``b``: its
    call through ``a`` was dumped as ``b`` and the one through ``b`` as ``b#1``, verify OK. At attach
    such a module is left out, with the reason (selection.shared_left_out); now after attach too."""
    from fastdump.capture.selection import SHARED_LEFT_OUT_REASON

    model, shared = TwoPaths(), nn.Linear(4, 4)
    if when == "at_attach":
        model.a = model.b = shared
    d = fastdump.attach(model, tmp_path, exclude="^a$")
    if when == "after_attach":
        model.a = shared
        model.b = shared
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x)
        keep = model.keep(x)
    d.close()
    assert d.not_wrapped == {"a": SHARED_LEFT_OUT_REASON.format(kept="b")}
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert sorted(dumped) == ["TwoPaths", "keep"]
    assert same_bits(dumped["keep"], keep) and same_bits(dumped["TwoPaths"], out)


def test_a_dumper_dropped_without_close_is_collected_with_its_model(tmp_path):
    """The registration hook (_follow_registrations) is global: holding its Dumper strongly, it kept
    every Dumper dropped without close(), its model and its rank directory's descriptor for the
    process's life, one more per attach."""
    hooks = torch.nn.modules.module._global_module_registration_hooks
    before = len(hooks)

    def attach_and_drop(i):
        model = Chain(3)
        d = fastdump.attach(model, tmp_path / str(i))
        with torch.no_grad():
            model(torch.randn(2, 4))
        return weakref.ref(model), weakref.ref(d)

    refs = [attach_and_drop(i) for i in range(3)]
    gc.collect()
    try:
        assert [(m(), d()) for m, d in refs] == [(None, None)] * 3
        assert len(hooks) == before
        # (the rank directories' DirAnchor, closed with it)
        held = open_fds_where(lambda target: target.startswith(str(tmp_path)))
        assert held == []
    finally:  # (the engine a dropped Dumper leaves, which the conftest check would report)
        from fastdump.staging.engine import Engine
        Engine._current.shutdown()
        Engine._current = None


@pytest.mark.parametrize("order", ["compile_then_attach", "attach_then_compile"])
def test_a_compiled_model_of_many_module_types_stays_compiled_while_dumped(tmp_path, order):
    """A model looping over its layers, compiled with fastdump attached, ran eagerly: compiled
    first, every pass (Dynamo met a C wrapper in the loop and skipped the model's forward for good;
    no graph at all); attached first, every module after the 8th (all wrappers shared one code
    object, recompiled per module up to Dynamo's recompile limit). The values were right either way."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    kinds = [lambda: nn.Linear(8, 8), nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, lambda: nn.LayerNorm(8)]

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(k() for k in kinds * 2)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch._dynamo.reset()
    counters.clear()
    model = Loop()
    if order == "compile_then_attach":
        compiled = torch.compile(model, backend="eager")
        d = fastdump.attach(compiled, tmp_path)
    else:
        d = fastdump.attach(model, tmp_path)
        compiled = torch.compile(model, backend="eager")
    xs = [torch.randn(2, 8) for _ in range(2)]
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
    d.close()
    # Each of the 12 modules compiled (its code before and after its dump's graph break), none left to eager.
    assert counters["stats"]["unique_graphs"] >= len(model.layers), dict(counters["stats"])
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1]
    for p, (x, out) in enumerate(zip(xs, outs)):
        dumped = ds.load("target", 0, p)
        assert sorted(dumped) == sorted([f"layers.{i}" for i in range(12)] + ["Loop"])
        with torch.no_grad():
            for i, layer in enumerate(model.layers):
                x = layer(x)
                assert same_bits(dumped[f"layers.{i}"], x), (p, i)
        assert same_bits(dumped["Loop"], out) and same_bits(out, x)


@pytest.mark.parametrize("order", ["compile_then_attach", "attach_then_compile"])
def test_a_fullgraph_compile_serves_undumped_and_verify_says_so(tmp_path, order):
    """fullgraph=True allows no graph break, and staging is one: such a compile raised into the
    model (Dynamo's Unsupported) while fastdump was attached. It serves now, its modules undumped,
    counted (stats compiled_not_dumped) and verify fails with the reason."""
    import torch._dynamo
    from fastdump.cli import dump as cli_dump

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    with torch.no_grad():
        want = model(x)
    if order == "compile_then_attach":
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        d = fastdump.attach(compiled, tmp_path)
    else:
        d = fastdump.attach(model, tmp_path)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        outs = [compiled(x), compiled(x)]
    stats = d.close()
    for out in outs:
        assert same_bits(out, want)
    ds = fastdump.open(tmp_path)
    if order == "compile_then_attach":  # the root wrapper runs before Dynamo: its passes, the output only
        assert stats["compiled_not_dumped"] == 3  # the three leaves, traced once
        assert ds.passes("target", 0) == [0, 1]
        for p in (0, 1):
            dumped = ds.load("target", 0, p)
            assert list(dumped) == ["Sequential"] and same_bits(dumped["Sequential"], want)
    else:  # the whole forward, the pass's begin and end included, is in the graph: no pass at all
        assert stats["compiled_not_dumped"] == 1
        assert stats["passes"] == 0
    report = cli_dump.verify_dump(str(tmp_path))
    assert [p.split(": ", 1)[1] for p in report.problems] == [
        f"{stats['compiled_not_dumped']} dumped module(s) were compiled into graphs that may not break "
        "(torch.compile fullgraph=True): that compiled code ran undumped"]
