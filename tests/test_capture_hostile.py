"""Hostile capture: odd tensors and odd module outputs, as a hostile user would return them.

The rule every test checks: what is dumped equals, bit for bit, what the module returned at the
moment its wrapper ran (a later in-place change must not leak in), or the tensor is recorded as a
skip with a reason (the pass's ``skipped``, rank.json's ``skipped_reasons``); the model is served
unchanged and never sees an error; and ``fastdump verify`` fails whenever data was lost or mixed.

Most models here run two passes: the first names every tensor (the Dumper's general path), the
second takes the hot path alone (the C forward wrapper and ``stage_tensor``), and both must agree.
"""

import collections
import contextlib
import dataclasses
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fastdump
from fastdump import _C, dtypes
from fastdump.cli import dump as cli_dump

try:
    from fastdump import _torch_reader
except ImportError:  # a build without the tensor reader: only the attribute path is tested
    _torch_reader = None

READERS = ["torch", "attributes"] if _torch_reader is not None else ["attributes"]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a uint8 tensor of shape (*t.shape, itemsize), aliasing t's storage (any dtype:
    many dtypes have no copy kernel of their own)."""
    size = t.element_size()
    base = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return base.as_strided([*t.shape, size], [s * size for s in t.stride()] + [1], t.storage_offset() * size)


def raw(t: torch.Tensor) -> torch.Tensor:
    """t's elements' bytes in C order: compared with torch.equal, NaN payloads and -0.0 included."""
    t = t.detach()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_conj():
        t = t.resolve_conj()
    return _byte_view(t).contiguous().reshape(-1)


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of t as it is now (dtype, shape, bits), immune to later in-place changes."""
    return raw(t).clone().view(t.dtype).reshape(t.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def scribble(t) -> None:
    """Overwrite (invert) every byte of t's storage in place: what a fused kernel or an in-place op
    in the parent does to a child's output after the child returned."""
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu":
        with torch.no_grad():
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).bitwise_not_()


def verify(root, data=True):
    return cli_dump.verify_dump(str(root), read_data=data)


@contextlib.contextmanager
def tensor_reader(which: str):
    """The process-wide tensor reader on ("torch") or off ("attributes") for the block."""
    from fastdump.staging import tensor_reader as reader_setup

    reader_setup.install()  # first, or the restore below would leave a not-yet-installed reader off for good
    before = _C.tensor_reader() is not None
    if _torch_reader is not None:
        _C.set_tensor_reader(_torch_reader.READER if which == "torch" else None)
    try:
        yield
    finally:
        if _torch_reader is not None:
            _C.set_tensor_reader(_torch_reader.READER if before else None)


def skipped_of(ds, p=0) -> dict:
    return {s["name"]: s["reason"] for s in ds.meta("target", 0, p)["skipped"]}


class Fn(nn.Module):
    """A leaf whose output is fn(x)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Scribbler(nn.Module):
    """Calls each child, snapshots what it returned, then overwrites it in place (as a fused kernel
    or an in-place activation in the parent would) before the next child runs."""

    def __init__(self, fns: dict, mutate=scribble):
        super().__init__()
        self.kids = nn.ModuleDict({k: Fn(fn) for k, fn in fns.items()})
        self.mutate = mutate
        self.seen = []  # one {name: snapshot} per forward

    def forward(self, x):
        seen = {}
        for key, kid in self.kids.items():
            out = kid(x)
            seen[key] = snapshot(out)
            self.mutate(out)
        self.seen.append(seen)
        return x.sum()


# ------------------------------------------------------------------ odd layouts, then overwritten


def _odd_layouts() -> dict:
    def fresh(x, n=24):  # a new tensor every call, computed from x (scribbling it spares x)
        return (x[:1] * 0 + torch.arange(float(n))).reshape(-1)

    return {
        "transposed": lambda x: fresh(x).reshape(4, 6).t(),
        "permuted_3d": lambda x: fresh(x).reshape(2, 3, 4).permute(2, 0, 1),
        "channels_last": lambda x: fresh(x, 48).reshape(2, 3, 2, 4).contiguous(memory_format=torch.channels_last),
        "expanded_stride0": lambda x: fresh(x, 3).reshape(3, 1).expand(3, 5),
        "expanded_all0": lambda x: fresh(x, 1).reshape(()).expand(4, 2, 3),
        "every_third": lambda x: fresh(x)[1::3],
        "storage_offset": lambda x: fresh(x)[7:].reshape(-1)[:5],
        "narrow_of_huge": lambda x: (x[:1] * 0 + torch.arange(4e6))[3_999_990:3_999_993],  # 16 MB storage
        "last_elements": lambda x: fresh(x).reshape(4, 6)[3:, 4:],
        "overlapping": lambda x: fresh(x, 8).as_strided((4, 3), (1, 1)),  # rows share elements
        "diagonal": lambda x: fresh(x, 16).reshape(4, 4).diagonal(),
        "zero_d": lambda x: fresh(x).sum(),
        "zero_d_view": lambda x: fresh(x)[5],
        "empty_0x5": lambda x: fresh(x, 0).reshape(0, 5),
        "empty_5x0": lambda x: fresh(x, 0).reshape(5, 0),
        "empty_strided": lambda x: torch.empty_strided((3, 0, 2), (0, 7, 1000)),
        # (5-1) * 2^62 overflows 64 bits: the tensor reader refused it as reaching past its storage
        "empty_behind_huge_strides": lambda x: torch.empty_strided((5, 0, 3), (1 << 62, 1, 1), dtype=torch.uint8),
        "dims_32": lambda x: fresh(x, 2).reshape([1] * 31 + [2]),
        "dims_32_strided": lambda x: fresh(x, 8).reshape([2] + [1] * 30 + [4])[:, ..., ::2],
        "unit_dims_odd_strides": lambda x: fresh(x, 6).as_strided((1, 6, 1), (99, 1, 1000)),
        "neg_bit": lambda x: torch.complex(fresh(x, 3), fresh(x, 3) + 1).conj().imag,  # lazy negation
        "int_view_of_float": lambda x: fresh(x).view(torch.int32)[::2],
        "byte_view": lambda x: fresh(x, 6).view(torch.uint8).reshape(6, 4).t(),
    }


@pytest.mark.parametrize("which", READERS)
def test_odd_layouts_are_dumped_as_returned_not_as_overwritten_later(tmp_path, which):
    fns = _odd_layouts()
    model = Scribbler(fns)
    x = torch.ones(3)
    with tensor_reader(which), fastdump.attach(model, tmp_path, root_name="root"):
        served = [model(x) for _ in range(3)]  # pass 0: the general path; 1 and 2: the hot path
    plain = Scribbler(fns)
    assert [model(x) for _ in range(3)] == served == [plain(x) for _ in range(3)]  # detached: same again
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    for p in range(3):
        dumped = ds.load("target", 0, p, check=True)
        assert skipped_of(ds, p) == {}
        assert set(dumped) == {f"kids.{k}" for k in fns} | {"root"}
        for key, want in model.seen[p].items():
            got = dumped[f"kids.{key}"]
            assert same_bits(got, want), (p, key, got, want)
        assert same_bits(dumped["root"], served[p])
    assert ds.rank_info("target", 0)["bytes"] < 3 * 4096  # the narrow slice, not its 16 MB storage
    assert not verify(tmp_path).problems


@pytest.mark.parametrize("which", READERS)
def test_views_at_storage_offsets_past_2_pow_31_elements_are_dumped_bit_exact(tmp_path, which):
    """Offsets past 2^31 elements (past 2^32 bytes in float16) in 32-bit arithmetic would read
    another part of the storage. The storages are allocated, not touched: only the viewed pages
    are ever written or read, so the test costs kilobytes of memory."""
    far = 1 << 31
    u8 = torch.empty(far + 64, dtype=torch.uint8)
    f16 = torch.empty(far + 64, dtype=torch.float16)
    u8[far:] = torch.arange(64, dtype=torch.uint8)
    f16[far:] = torch.arange(64, dtype=torch.float16) - 31.5
    model = Each(lambda x: u8[far + 3:far + 13], lambda x: f16[far + 3:far + 63:7],
                 lambda x: f16.as_strided((3, 4), (1, 5), far + 1), lambda x: f16[far + 60:].view(torch.int32))
    with tensor_reader(which), fastdump.attach(model, tmp_path):
        for _ in range(2):
            model(torch.zeros(1))
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load("target", 0, p, check=True)
        assert skipped_of(ds, p) == {} and len(dumped) == 4
        for i, want in enumerate(model.outs[p]):
            assert same_bits(dumped[f"kids.{i}"], want), (p, i)
    assert not verify(tmp_path).problems


# ------------------------------------------------------------------------- every dtype, overwritten


def _every_dtype(x) -> dict:
    """One tensor per dtype torch has (and fastdump's table names), every bit pattern, strided."""
    gen = torch.Generator().manual_seed(int(x.sum()))
    out = {}
    for name in dtypes.NAMES:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            continue
        size = dtypes.ITEMSIZE[dtypes.CODE_BY_NAME[name]]
        bytes_ = torch.randint(0, 256, (4, 6 * size), dtype=torch.uint8, generator=gen)
        if name == "bool":
            out[name] = (bytes_ % 2 == 1).t()[::2]
        else:
            out[name] = bytes_.view(dtype).t()[1::2]  # NaN payloads, -0.0, subnormals, strided
    out["float32_specials"] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    for name in ("complex32", "complex64", "complex128"):  # the lazy conjugation bit, not in the bytes
        out[f"{name}_conj"] = out[name].conj()
    return out


class DtypeZoo(nn.Module):
    def __init__(self, container):
        super().__init__()
        self.container = container

    def forward(self, x):
        values = _every_dtype(x)
        return tuple(values.values()) if self.container == "tuple" else values


class DtypeParent(nn.Module):
    def __init__(self, container):
        super().__init__()
        self.zoo = DtypeZoo(container)
        self.seen = []

    def forward(self, x):
        out = self.zoo(x)
        values = out if isinstance(out, dict) else dict(zip(_every_dtype(x), out))
        self.seen.append({k: snapshot(v) for k, v in values.items()})
        for v in values.values():
            scribble(v)
        return x


@pytest.mark.parametrize("container", ["tuple", "dict"])  # tuple: the C wrapper's path; dict: Python's
def test_every_dtype_a_module_returns_is_dumped_bit_exact_before_it_is_overwritten(tmp_path, container):
    model = DtypeParent(container)
    with warnings.catch_warnings(), fastdump.attach(model, tmp_path) as d:
        warnings.simplefilter("ignore")  # complex32: "experimental"
        for step in range(2):
            model(torch.full((2,), float(step)))
    assert d.stats()["skipped"] == 0
    ds = fastdump.open(tmp_path)
    keys = list(_every_dtype(torch.zeros(1)))
    for p in range(2):
        dumped = ds.load("target", 0, p, check=True)
        for i, key in enumerate(keys):
            name = f"zoo.{i}" if container == "tuple" else f"zoo.{key}"
            assert same_bits(dumped[name], model.seen[p][key]), (p, key)
    assert not verify(tmp_path).problems


# ------------------------------------------------------------------------------- odd containers

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass(frozen=True)
class Frozen:
    hidden: torch.Tensor
    extra: object = None
    note: str = "n"


def _tensors_in(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, out)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _tensors_in(getattr(value, f.name), out)
    return out


class Containers(nn.Module):
    """Each child returns a container; the parent snapshots it, then scribbles every tensor in it."""

    def __init__(self):
        super().__init__()
        a = lambda x, k: x * 0 + k  # noqa: E731 - a fresh tensor each call
        self.fns = {
            "tuple": lambda x: (a(x, 1), None, a(x, 2)),
            "list": lambda x: [a(x, 3), [a(x, 4), (a(x, 5),)]],
            "dict": lambda x: {"q": a(x, 6), "k": {"inner": a(x, 7)}, "none": None},
            "ordered": lambda x: collections.OrderedDict(z=a(x, 8), a=a(x, 9)),
            "int_keys": lambda x: {3: a(x, 10), None: a(x, 11), (1, 2): a(x, 12)},
            "namedtuple": lambda x: Pair(a(x, 13), Pair(a(x, 14), None)),
            "dataclass": lambda x: Frozen(a(x, 15), extra=[a(x, 16), 2]),
            "scalars": lambda x: (1, 2.5, True, "s", b"b", None, a(x, 17), torch.Size([2, 3])),
            "same_twice": lambda x: (lambda t: (t, t, [t]))(a(x, 18)),
            "many": lambda x: tuple(a(x, 100 + i) for i in range(70)),  # over the C path's 64
            "only_none": lambda x: None,
            "an_int": lambda x: 7,
            "empty_tuple": lambda x: (),
            "empty_dict": lambda x: {},
        }
        self.kids = nn.ModuleDict({k: Fn(fn) for k, fn in self.fns.items()})
        self.shared = Fn(lambda x: x * 0 + 19)
        self.seen = []

    def forward(self, x):
        seen = {}
        for key, kid in self.kids.items():
            out = kid(x)
            seen[key] = [snapshot(t) for t in _tensors_in(out, [])]
            for t in _tensors_in(out, []):
                scribble(t)
        t = self.shared(x)
        again = nn.Identity()(t)  # not a child: returns the same object
        seen["shared"] = [snapshot(t)]
        self.seen.append(seen)
        return t, again, {"t": t}


EXPECTED_NAMES = {
    "tuple": ["0", "2"],
    "list": ["0", "1.0", "1.1.0"],
    "dict": ["q", "k.inner"],
    "ordered": ["z", "a"],
    "int_keys": ["3", "None", "(1, 2)"],
    "namedtuple": ["0", "1.0"],
    "dataclass": ["hidden", "extra.0"],
    "scalars": ["6"],
    "same_twice": ["0", "1", "2.0"],
    "many": [str(i) for i in range(70)],
    "only_none": [], "an_int": [], "empty_tuple": [], "empty_dict": [],
}


def test_containers_are_flattened_bit_exact_in_order_and_nothing_else_is_recorded(tmp_path):
    model = Containers()
    x = torch.arange(3.0)
    with fastdump.attach(model, tmp_path, root_name="root"):
        served = [model(x) for _ in range(2)]
    assert all(s[0] is s[1] is s[2]["t"] for s in served)  # the model's own objects, untouched
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load("target", 0, p, check=True)
        assert skipped_of(ds, p) == {}, p  # None, ints, strings, Size: not tensor data, not a skip
        want = []
        for key, suffixes in EXPECTED_NAMES.items():
            names = [f"kids.{key}" + (f".{s}" if s else "") for s in suffixes]
            want += names
            assert len(names) == len(model.seen[p][key]), key
            for name, snap in zip(names, model.seen[p][key]):
                assert same_bits(dumped[name], snap), (p, name)
        want += ["shared", "root.0", "root.1", "root.2.t"]
        assert list(dumped) == want  # dump order: the order the tensors were returned
        for name in ("shared", "root.0", "root.1", "root.2.t"):
            assert same_bits(dumped[name], model.seen[p]["shared"][0]), name
    assert not verify(tmp_path).problems



class _Nested(nn.Module):
    """Returns ``x`` inside ``depth`` one-element lists."""

    def __init__(self, depth: int):
        super().__init__()
        self.depth = depth

    def forward(self, x):
        out = x * 2
        for _ in range(self.depth):
            out = [out]
        return out


def test_an_output_nested_32_containers_deep_is_dumped_and_33_is_a_recorded_skip(tmp_path, kind):
    """The nesting limit is exact: a tensor inside 32 containers is dumped under its 32 parts, one
    inside 33 is skipped with the reason at the 33rd container (never a RecursionError into the
    model). A mutant that let a 33rd level through survived every test."""
    model = nn.Sequential(_Nested(32), _Nested(33))
    x = torch.arange(3.0)
    with fastdump.attach(model, tmp_path, root_passes=False) as d, torch.no_grad():
        with d.manual_pass():
            model[0](x), model[1](x)  # (each child on x)
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    assert list(dumped) == ["0" + ".0" * 32] and same_bits(dumped["0" + ".0" * 32], x * 2)
    assert skipped_of(ds, 0) == {"1" + ".0" * 32: "nested more than 32 containers deep"}


def test_dict_keys_that_print_alike_keep_the_first_and_skip_the_other_with_the_reason(tmp_path):
    """{0: a, "0": b} flattens to two parts named ``name.0``. Both were kept (``name.0``,
    ``name.0#dup1``) and verify failed the pass as mixed, though nothing was mixed; which was which
    could not be told either way. Now the first keeps the name and the second is a recorded skip."""
    model = nn.Sequential(Fn(lambda x: {0: x + 1, "0": x + 2}))
    x = torch.arange(3.0)
    with fastdump.attach(model, tmp_path):
        model(x)
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    assert same_bits(dumped["0.0"], x + 1) and same_bits(dumped["Sequential.0"], x + 1)
    assert not [name for name in dumped if "#dup" in name]
    assert set(skipped_of(ds, 0)) == {"0.0", "Sequential.0"}
    assert not verify(tmp_path, data=False).problems



class KwargsLeaf(nn.Module):
    """A leaf taking any keyword (**kwargs) and returning a dict whose keys a hostile model chose."""

    def __init__(self, keys):
        super().__init__()
        self.keys = keys

    def forward(self, x, **kwargs):
        return {key: x + i for i, key in enumerate(self.keys)}


class CallsKwargsLeaf(nn.Module):
    def __init__(self, keys, kwargs):
        super().__init__()
        self.leaf, self.kwargs = KwargsLeaf(keys), kwargs

    def forward(self, x):
        return self.leaf(x, **{key: x * (i + 10) for i, key in enumerate(self.kwargs)})["keep"]


def test_an_output_key_or_keyword_that_reads_as_an_input_name_keeps_the_first_and_skips_the_other(tmp_path):
    """With inputs=True a module's inputs are ``name.input.0`` ...; an output dict's key "input.0",
    or a keyword argument "0" (a forward taking **kwargs), gave a second tensor that name: both
    were stored (``name.input.0#dup1``) and verify failed the pass as mixed, which was which lost.
    Now the first value under a name keeps it (the positional input) and the others are recorded
    skips."""
    model = CallsKwargsLeaf(["input.0", "keep", "input.1"], ["0", "1", "ok"])
    x = torch.arange(3.0)
    with fastdump.attach(model, tmp_path, inputs=True, root_name="root"):
        for _ in range(2):  # the second: the names are known
            model(x)
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load("target", 0, p, check=True)
        assert not [name for name in dumped if "#dup" in name], p
        assert same_bits(dumped["leaf.input.0"], x)  # the positional input, not the output's "input.0"
        assert same_bits(dumped["leaf.input.1"], x * 11)  # the keyword "1" (no positional 1), not the output's
        assert same_bits(dumped["leaf.input.ok"], x * 12) and same_bits(dumped["leaf.keep"], x + 1)
        skipped = skipped_of(ds, p)
        assert set(skipped) == {"leaf.input.0", "leaf.input.1"}, skipped  # keyword "0", then the output's
        assert all("same name" in reason for reason in skipped.values())
    assert not verify(tmp_path).problems


def test_a_key_that_reads_as_a_call_number_is_a_recorded_skip(tmp_path):
    """Call numbering alone adds ``#k`` parts to names (``a#1``: a's second call in the pass). An
    output dict's key "b#1", a keyword argument "c#2" (inputs=True) or a watch() before-hook's key
    "d#3" made a name that reads as the call of a module that was never called (``leaf.b#1``:
    module ``leaf.b``, call 1, for the SGLang export). Now each is a recorded skip; keys that only
    hold a '#' ("#", "e#f", "g#1h") are names as any other."""
    model = CallsKwargsLeaf(["keep", "b#1", "#", "e#f", "g#1h", "x.#2.y"], ["c#2", "ok"])
    x = torch.arange(3.0)
    with fastdump.attach(model, tmp_path, inputs=True, root_name="root", exclude="leaf") as d:
        d.watch(model.leaf, "leaf", before=lambda args, kwargs: {"d#3": args[0] * 5, "d": args[0] * 6})
        model(x)
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0, check=True)
    for key, i in (("keep", 0), ("#", 2), ("e#f", 3), ("g#1h", 4)):
        assert same_bits(dumped[f"leaf.{key}"], x + i), key
    assert same_bits(dumped["leaf.input.ok"], x * 11) and same_bits(dumped["leaf.d"], x * 6)
    skipped = skipped_of(ds, 0)
    assert set(skipped) == {"leaf.b#1", "leaf.x.#2.y", "leaf.input.c#2", "leaf.d#3"}, skipped
    assert all("repeated call" in reason for reason in skipped.values())
    assert not [name for name in dumped if _reads_as_call(name)]
    assert not verify(tmp_path).problems


def _reads_as_call(name: str) -> bool:
    from fastdump import format as fmt

    return fmt.reads_as_call(name)


class BadKey:
    def __format__(self, spec):
        raise RuntimeError("no text for this key")


@dataclasses.dataclass
class Unset:
    a: torch.Tensor
    b: torch.Tensor = dataclasses.field(init=False)  # never set: reading it raises
    c: torch.Tensor = None


class Each(nn.Module):
    """Calls each child on x; returns nothing."""

    def __init__(self, *fns):
        super().__init__()
        self.kids = nn.ModuleList(Fn(fn) for fn in fns)
        self.outs = []

    def forward(self, x):
        self.outs.append([kid(x) for kid in self.kids])


def test_an_unreadable_container_entry_costs_only_itself_and_is_recorded(tmp_path):
    """A dict key that cannot be turned into text, a dataclass field that cannot be read: that entry
    is a recorded skip; its siblings, before and after it, are dumped; the model never sees it."""
    model = Each(lambda x: {"a": x + 1, BadKey(): x + 2, "c": x + 3}, lambda x: Unset(x + 4, c=x + 5),
                 lambda x: iter([x]))
    x = torch.arange(3.0)
    with fastdump.attach(model, tmp_path):
        model(x)
    out = model.outs[0]
    assert isinstance(out[1], Unset) and same_bits(next(out[2]), x)  # served as returned, not consumed
    ds = fastdump.open(tmp_path)
    dumped, skipped = ds.load("target", 0, 0), skipped_of(ds)
    assert list(dumped) == ["kids.0.a", "kids.0.c", "kids.1.a", "kids.1.c"]
    for name, want in zip(dumped, (x + 1, x + 3, x + 4, x + 5)):
        assert same_bits(dumped[name], want), name
    assert skipped.keys() == {"kids.0.<BadKey key>", "kids.1.b", "kids.2"}
    assert "no text for this key" in skipped["kids.0.<BadKey key>"]
    assert "has no attribute 'b'" in skipped["kids.1.b"] and "Unset" in skipped["kids.1.b"]
    assert "holds no tensor" in skipped["kids.2"]
    assert not verify(tmp_path).problems


# ----------------------------------------------------------------------------- tensor subclasses


class Counting(torch.Tensor):
    """A __torch_function__ subclass that minds its own business (counts what is done to it)."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Counting.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class Refusing(torch.Tensor):
    """A subclass that refuses every attribute read fastdump would make (data_ptr, shape, ...)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("data_ptr", "__get__", "stride", "is_neg", "dim", "element_size"):
            raise RuntimeError("refused by the subclass")
        return super().__torch_function__(func, types, args, kwargs or {})


class Subclasses(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.param = Fn(lambda x: self.weight)  # returns a Parameter (requires_grad, a subclass)
        self.counting = Fn(lambda x: (x * 2).as_subclass(Counting))
        self.counting_view = Fn(lambda x: (x.repeat(2) * 3).as_subclass(Counting)[1::2])

    def forward(self, x):
        return self.param(x), self.counting(x), self.counting_view(x)


@pytest.mark.parametrize("which", READERS)
def test_parameters_and_torch_function_subclasses_are_dumped_and_served_as_they_are(tmp_path, which):
    model = Subclasses()
    x = torch.arange(4.0)
    with tensor_reader(which), fastdump.attach(model, tmp_path, root_name="root"):
        served = [model(x) for _ in range(2)]
    for out in served:
        assert out[0] is model.weight and type(out[1]) is Counting and type(out[2]) is Counting
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load("target", 0, p)
        assert skipped_of(ds, p) == {}
        for name, want in (("param", model.weight), ("counting", x * 2), ("counting_view", (x.repeat(2) * 3)[1::2])):
            assert type(dumped[name]) is torch.Tensor
            assert same_bits(dumped[name], want.detach().as_subclass(torch.Tensor)), (p, name)
            assert same_bits(dumped[f"root.{list(dict(model.named_children())).index(name)}"], dumped[name])
    assert not verify(tmp_path).problems


@pytest.mark.parametrize("which", READERS)
def test_a_subclass_that_refuses_to_be_read_is_a_recorded_skip(tmp_path, which):
    model = Each(lambda x: x + 1, lambda x: (x * 3).as_subclass(Refusing), lambda x: x - 1)
    x = torch.arange(3.0)
    with tensor_reader(which), fastdump.attach(model, tmp_path):
        for _ in range(2):
            model(x)
    assert all(type(o[1]) is Refusing for o in model.outs)
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load("target", 0, p)
        assert same_bits(dumped["kids.0"], x + 1) and same_bits(dumped["kids.2"], x - 1)
        if which == "torch":  # its TensorImpl is read, no attribute asked: its values, bit for bit
            assert same_bits(dumped["kids.1"], x * 3) and skipped_of(ds, p) == {}, p
        else:
            assert "kids.1" not in dumped
            assert "refused by the subclass" in skipped_of(ds, p).get("kids.1", ""), p  # not lost silently
    assert ds.rank_info("target", 0)["skipped"] == (0 if which == "torch" else 2)


class Babbling(torch.Tensor):
    """A subclass whose __torch_function__ answers a string for everything asked of it (nbytes,
    is_nested, shape, ...), as a wrapper library's catch-all may: its TensorImpl is a plain tensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return "babble"


@pytest.mark.parametrize("which", READERS)
def test_a_subclass_answering_strings_is_dumped_once_and_not_also_recorded_as_a_nested_skip(tmp_path, which):
    """Once staged, the tensor's nbytes was read from the subclass: the string raised, so a tensor
    in the dump was also a recorded skip, for a reason read from the subclass too ("nested tensor
    (layout babble)": its is_nested answered a truthy string), and its bytes missed the totals."""
    model = Each(lambda x: x + 1, lambda x: (x * 3).as_subclass(Babbling), lambda x: x - 1)
    x = torch.arange(3.0)
    with tensor_reader(which), fastdump.attach(model, tmp_path) as d:
        for _ in range(2):
            model(x)
        totals = d.stats()
    assert all(type(o[1]) is Babbling for o in model.outs)
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load("target", 0, p)
        assert skipped_of(ds, p) == {}, p
        assert same_bits(dumped["kids.0"], x + 1) and same_bits(dumped["kids.2"], x - 1)
        assert same_bits(dumped["kids.1"], x * 3), p
    assert (totals["skipped"], totals["tensors"], totals["bytes"]) == (0, 6, 6 * 12)
    assert not verify(tmp_path).problems


class Liar(torch.Tensor):
    """A subclass whose .shape and .stride() claim more than its TensorImpl holds."""

    @property
    def shape(self):
        return torch.Size([1 << 18])

    def stride(self, *args):
        return (1,)


@pytest.mark.skipif(_torch_reader is None, reason="without the torch reader a subclass's Python attributes are "
                                                "all fastdump can read (docs/INTERNALS.md)")
def test_a_subclass_that_lies_about_its_shape_is_never_read_past_its_elements(tmp_path):
    # The lie stays inside one big storage here, so the bug reads the storage's other elements, not
    # unmapped memory: deterministic, and the test process survives.
    storage = torch.arange(float(1 << 18))
    model = Each(lambda x: storage[:4].as_subclass(Liar))
    with fastdump.attach(model, tmp_path):
        model(torch.zeros(1))
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    if "kids.0" in dumped:  # what the TensorImpl holds, or a recorded skip
        assert same_bits(dumped["kids.0"], storage[:4])
    else:
        assert "kids.0" in skipped_of(ds)


class Logging(TorchDispatchMode):
    """A dispatch mode that records every op (as a profiler's or a debugging mode does) and, when
    asked to, changes what copies compute: neither may see or change fastdump's own work."""

    def __init__(self, scale=None):
        super().__init__()
        self.ops, self.scale = [], scale

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        out = func(*args, **(kwargs or {}))
        if self.scale is not None and func in (torch.ops.aten.clone.default, torch.ops.aten._conj_physical.default):
            out = out * self.scale
        return out


class FunctionLog(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


_METADATA_READS = {"__get__", "is_conj", "is_neg", "element_size", "stride", "data_ptr", "untyped_storage"}


def _lazy_bits():
    return Each(lambda x: torch.complex(x, -x).conj(), lambda x: torch.complex(x, x + 1).conj().imag, lambda x: x + 1)



def test_a_lazy_conj_or_neg_broadcast_is_resolved_over_its_storage_range_not_its_shape(tmp_path, monkeypatch):
    """A conj or neg view's bits are resolved into a copy before staging. resolve_conj() of an
    expanded view copies every element of its shape: a complex scalar expanded to 2^27 elements
    cost the model's process 1 GiB (measured: max RSS +1.1 GiB, then skipped anyway under `drop`,
    larger than the ring). Now the copy covers the storage range the view addresses (one element
    here), and the view's strides are laid over it: the same bits, a fraction of the memory."""
    resolved = []
    for method in ("resolve_conj", "resolve_neg"):
        original = getattr(torch.Tensor, method)

        def spy(t, _original=original):  # fastdump's copies (not the test's own snapshots)
            if (t.is_conj() or t.is_neg()) and sys._getframe(1).f_globals["__name__"].startswith("fastdump."):
                resolved.append(torch.Tensor.numel(t))
            return _original(t)

        monkeypatch.setattr(torch.Tensor, method, spy)

    def fresh(x, n):
        return x[:1] * 0 + torch.arange(float(n))

    def cplx(x, n):
        return torch.complex(fresh(x, n), -fresh(x, n) - 0.5)

    fns = {
        "scalar_expanded": lambda x: cplx(x, 1).reshape(()).expand(64, 1000).conj(),
        "column_expanded": lambda x: cplx(x, 3).reshape(3, 1).expand(3, 500).conj(),
        "overlapping": lambda x: cplx(x, 16).as_strided((13, 4), (1, 1)).conj(),
        "neg_expanded": lambda x: cplx(x, 2).conj().imag[1:].expand(300, 7),
        "complex32_expanded": lambda x: cplx(x, 2).to(torch.complex32)[:1].expand(9, 200).conj(),
        "offset_expanded": lambda x: cplx(x, 6)[4:5].expand(2, 500).conj(),
        "dense": lambda x: cplx(x, 6).reshape(2, 3).t().conj(),  # (resolved whole: its range is its size)
    }
    model = Scribbler(fns)
    x = torch.ones(3)
    with warnings.catch_warnings(), fastdump.attach(model, tmp_path, root_name="root"):
        warnings.simplefilter("ignore")  # complex32: "experimental"
        for _ in range(2):
            model(x)
    assert resolved and max(resolved) <= 16, resolved  # the overlapping view's range (of its 52 elements)
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load("target", 0, p, check=True)
        assert skipped_of(ds, p) == {}
        for key, want in model.seen[p].items():
            assert same_bits(dumped[f"kids.{key}"], want), (p, key)
    assert not verify(tmp_path).problems


class DtypeLiar(torch.Tensor):
    """A subclass whose .dtype claims float64 over float32 elements."""

    @property
    def dtype(self):
        return torch.float64


@pytest.mark.parametrize("which", READERS)
def test_a_subclass_that_lies_about_its_dtype_is_read_as_its_tensorimpl_holds_it(tmp_path, which):
    """The general path read a tensor's dtype, layout and lazy bits through its Python
    attributes: without the tensor reader (a build without it, another torch), a subclass claiming
    float64 over float32 elements had the copy read twice its bytes, the storage's next elements,
    and dump them as float64 (or a skip saying its storage was freed, where the storage ended).
    Now they are read from the TensorImpl, as the shape and address were: the float32 values."""
    storage = torch.arange(64.0)
    model = Each(lambda x: storage[:4].as_subclass(DtypeLiar), lambda x: (storage[:4] * 2).as_subclass(DtypeLiar))
    with tensor_reader(which), fastdump.attach(model, tmp_path):
        for _ in range(2):
            model(torch.zeros(1))
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load("target", 0, p, check=True)
        assert same_bits(dumped["kids.0"], storage[:4]) and same_bits(dumped["kids.1"], storage[:4] * 2), p
        assert skipped_of(ds, p) == {}, p
    assert not verify(tmp_path).problems


@pytest.mark.parametrize("which", READERS)
def test_the_callers_modes_neither_see_nor_change_the_copy_of_a_lazy_conj_or_neg_view(tmp_path, which):
    """A conj or neg view is resolved into a copy before staging. That copy ran through the modes
    active in the forward: a logging mode saw ops the model never ran, and a mode that changes
    results (here: scales every copy) made the dump differ from what the module returned."""
    x = torch.arange(3.0)
    seen = []
    for attached in (False, True):
        model = _lazy_bits()
        with contextlib.ExitStack() as stack:
            if attached:
                stack.enter_context(tensor_reader(which))
                stack.enter_context(fastdump.attach(model, tmp_path))
            modes = [(Logging(scale), FunctionLog()) for scale in (None, 10, None, 10)]  # passes 0-3
            for dispatch, function in modes:
                with function, dispatch:
                    model(x)
        # (A function mode is asked about the metadata fastdump reads on its general path.)
        seen.append([(d.ops, [c for c in f.calls if c not in _METADATA_READS]) for d, f in modes])
    assert seen[0] == seen[1]  # the modes saw the model's ops, no op of fastdump's
    ds = fastdump.open(tmp_path)
    for p, outs in enumerate(model.outs):
        dumped = ds.load("target", 0, p)
        assert skipped_of(ds, p) == {}
        for i, out in enumerate(outs):
            assert same_bits(dumped[f"kids.{i}"], out), (p, i)  # what the module returned, resolved here
    assert not verify(tmp_path).problems


# ------------------------------------------------------------- what cannot be stored: recorded skips


def test_sparse_meta_quantized_and_object_arrays_are_recorded_skips_numpy_arrays_are_dumped(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR "beta", quantize "deprecated"
        model = Each(
            lambda x: x.reshape(2, 3).to_sparse(),
            lambda x: x.reshape(2, 3).to_sparse_csr(),
            lambda x: torch.empty(3, device="meta"),
            lambda x: torch.quantize_per_tensor(x, 0.5, 0, torch.qint8),
            lambda x: np.array([1, "a"], dtype=object),
            lambda x: np.arange(6, dtype=np.float32)[::-2],  # numpy: negative strides
            lambda x: np.frombuffer(bytes(range(8)), dtype=np.uint8),  # read-only
            lambda x: np.array([[True, False, True]]).T,
            lambda x: x + 1,
        )
        x = torch.arange(6.0)
        with fastdump.attach(model, tmp_path):
            for _ in range(2):
                model(x)
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped, skipped = ds.load("target", 0, p), skipped_of(ds, p)
        assert "not strided" in skipped["kids.0"] and "not strided" in skipped["kids.1"]
        assert "meta" in skipped["kids.2"] and "quantized" in skipped["kids.3"]
        assert "kids.4" in skipped and len(skipped) == 5
        assert same_bits(dumped["kids.5"], torch.tensor([5.0, 3.0, 1.0]))
        assert same_bits(dumped["kids.6"], torch.arange(8, dtype=torch.uint8))
        assert same_bits(dumped["kids.7"], torch.tensor([[True], [False], [True]]))
        assert same_bits(dumped["kids.8"], x + 1)
    assert sum(ds.rank_info("target", 0)["skipped_reasons"].values()) == 10
    assert not verify(tmp_path).problems


# ------------------------------------------------------------------------ autograd and inference mode


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.act, self.down = nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)

    def forward(self, x):
        h = self.up(x)
        return self.down(self.act(h))  # the in-place ReLU overwrites up's output after it returned


def test_grad_mode_and_inference_mode_serve_the_same_results_and_gradients(tmp_path):
    x = torch.randn(3, 4)
    plain = Mlp()
    want = plain(x)
    want.sum().backward()
    want_grads = [p.grad.clone() for p in plain.parameters()]
    model = Mlp()
    with fastdump.attach(model, tmp_path, root_name="mlp"):
        out = model(x)                          # pass 0: grad mode
        out.sum().backward()
        with torch.inference_mode():
            inf = model(x)                      # pass 1: inference mode
        with torch.no_grad():
            model(x)                            # pass 2
    assert same_bits(out, want) and out.requires_grad and out.grad_fn is not None
    assert inf.is_inference() and same_bits(inf, want)
    assert all(same_bits(p.grad, g) for p, g in zip(model.parameters(), want_grads))
    up = nn.functional.linear(x, plain.up.weight, plain.up.bias).detach()
    ds = fastdump.open(tmp_path)
    for p in range(3):
        dumped = ds.load("target", 0, p)
        assert same_bits(dumped["up"], up), p  # before the in-place ReLU
        assert same_bits(dumped["act"], up.relu()) and same_bits(dumped["mlp"], want.detach())
        assert not dumped["mlp"].requires_grad
    assert not verify(tmp_path).problems


# ---------------------------------------------------------------------- torch.func and stateless calls


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("which", READERS)
def test_functional_calls_dump_the_swapped_parameters_results_and_transforms_are_recorded_skips(tmp_path, which):
    """functional_call runs the module with other parameters: what is dumped is what that call
    computed. Inside vmap, grad, jvp and functionalize a module's output is torch.func's wrapper,
    whose TensorImpl holds no values: a recorded skip saying so (it read as a freed storage), never
    bytes read from the wrapper; what the transforms return is what they return without fastdump."""
    x = torch.randn(5, 3)
    plain = _tiny()
    swapped = {k: v.detach() * 2 + 1 for k, v in plain.named_parameters()}
    transforms = {
        "vmap": lambda m: torch.func.vmap(m)(x),
        "grad": lambda m: torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).sum())(
            dict(m.named_parameters())),
        "jvp": lambda m: torch.func.jvp(m, (x,), (torch.ones_like(x),)),
        "functionalize": lambda m: torch.func.functionalize(m)(x),
    }
    want = {k: f(plain) for k, f in transforms.items()}
    model = _tiny()
    with tensor_reader(which), fastdump.attach(model, tmp_path, root_name="root"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stateless.functional_call is deprecated
        for _ in range(2):  # passes 0-1, then 6-7: names new, then the hot path
            served = [torch.func.functional_call(model, swapped, (x,)),
                      torch.nn.utils.stateless.functional_call(model, swapped, (x,))]
            got = {k: f(model) for k, f in transforms.items()}  # passes 2-5, then 8-11
            assert all(same_bits(a, b) for k in want for a, b in zip(
                torch.utils._pytree.tree_leaves(got[k]), torch.utils._pytree.tree_leaves(want[k]))), k
    lin = nn.functional.linear
    first = lin(x, swapped["0.weight"], swapped["0.bias"])
    last = lin(first.tanh(), swapped["2.weight"], swapped["2.bias"])
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == list(range(12))
    for p in range(12):
        dumped, skipped = ds.load("target", 0, p), skipped_of(ds, p)
        if p % 6 < 2:
            assert skipped == {} and list(dumped) == ["0", "1", "2", "root"]
            assert same_bits(dumped["0"], first) and same_bits(dumped["root"], last), p
            assert same_bits(dumped["1"], first.tanh()) and same_bits(served[p % 6], dumped["root"])
        else:
            assert dumped == {} and set(skipped) == {"0", "1", "2", "root"}, p
            assert all("torch.func transform" in why for why in skipped.values()), skipped
    assert not verify(tmp_path).problems


# ------------------------------------------------------------------------ other libraries' hooks


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


@pytest.mark.parametrize("native", [True, False])
def test_hooks_of_other_libraries_change_what_the_next_module_receives_not_the_dump(tmp_path, monkeypatch, native):
    """The documented semantics, hook by hook: a module's dump is what its forward returned,
    before its forward hooks (replacing, in place, prepended, always_call, global); its inputs
    (inputs=True) are what its forward received, after its pre-hooks (with_kwargs too); hooks
    registered before or after attach, or removed between passes, alike. The root's own hooks run
    outside its pass: modules they call are not dumped."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_wrappers", native)
    model, x = Chain(), torch.randn(2, 3)
    model.b.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model.a.register_forward_hook(lambda m, args, out: out + 100)
    model.register_forward_hook(lambda m, args, out: model.a(out))  # outside the pass
    with fastdump.attach(model, tmp_path, inputs=True, root_name="root") as d:
        model.c.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] - 1,), kwargs), with_kwargs=True)
        model.c.register_forward_hook(lambda m, args, out: out.add_(0.5))  # in place, after the next
        model.c.register_forward_hook(lambda m, args, out: out * 3, prepend=True, always_call=True)
        every = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out.neg() if m is model.b else None)
        with torch.no_grad():
            served = [model(x)]
            every.remove()
            served.append(model(x))
    lin = nn.functional.linear
    with torch.no_grad():
        a = lin(x, model.a.weight, model.a.bias)
        b_in = (a + 100) * 2
        b = lin(b_in, model.b.weight, model.b.bias)
        want = []
        for b_out in (-b, b):  # the global hook, then without it
            c_in = b_out - 1
            c = lin(c_in, model.c.weight, model.c.bias)
            root = c * 3 + 0.5
            want.append({"a": a, "a.input.0": x, "b": b, "b.input.0": b_in, "c": c, "c.input.0": c_in,
                         "root": root, "root.input.0": x})
            assert same_bits(served[len(want) - 1], lin(root, model.a.weight, model.a.bias) + 100)
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1]
    for p in range(2):
        dumped = ds.load("target", 0, p)
        assert sorted(dumped) == sorted(want[p]), p  # no a#1: the root's hook ran after its pass
        for name, value in want[p].items():
            assert same_bits(dumped[name], value), (p, name)
    assert not verify(tmp_path).problems


def test_autocast_and_a_fake_tensor_pass_dump_real_values_or_nothing(tmp_path):
    """Under autocast a module returns bfloat16: dumped as returned. Under FakeTensorMode nothing
    runs for real: that forward is no pass (it was a pass of recorded skips, which shifted every
    later pass id against a run without it), as torch.export's are not, and the passes around it
    are dumped bit-exact."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, x = Mlp(), torch.randn(3, 4)
    with fastdump.attach(model, tmp_path, root_name="mlp"), torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = model(x)                                      # pass 0
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model(fake.from_tensor(x))                           # no pass
        real = model(x)                                          # pass 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        up_cast = model.up(x)
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1]
    dumped = [ds.load("target", 0, p) for p in range(2)]
    assert cast.dtype == torch.bfloat16 and same_bits(dumped[0]["mlp"], cast)
    assert same_bits(dumped[0]["up"], up_cast)
    assert same_bits(dumped[1]["mlp"], real) and skipped_of(ds, 1) == {}
    assert not verify(tmp_path).problems


# --------------------------------------------------------------- storage changed after the return


class Cache(nn.Module):
    """Returns its own buffer, updated in place, on every call (a KV cache's way)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4))

    def forward(self, x):
        self.buf.add_(x)
        return self.buf


class Shrinks(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache, self.make = Cache(), Fn(lambda x: x * 10)

    def forward(self, x):
        first = self.cache(x)
        second = self.cache(x)  # the same object again: name#1
        made = self.make(x)
        made.untyped_storage().resize_(0)  # freed right after return (as FSDP does)
        first.mul_(-1)
        return second is first


def test_a_returned_buffer_changed_or_freed_after_return_is_dumped_as_it_was(tmp_path):
    model = Shrinks()
    x = torch.arange(4.0)
    with fastdump.attach(model, tmp_path):
        assert model(x) is True and model(x) is True
    ds = fastdump.open(tmp_path)
    buf = torch.zeros(4)
    for p in range(2):
        dumped = ds.load("target", 0, p)
        buf = buf + x
        assert same_bits(dumped["cache"], buf), p
        buf = buf + x
        assert same_bits(dumped["cache#1"], buf), p
        buf = -buf
        assert same_bits(dumped["make"], x * 10), p
    assert same_bits(model.cache.buf, buf)
    assert not verify(tmp_path).problems


# ------------------------------------------------------------------------ larger than the ring


class Big(nn.Module):
    """Returns tensors larger than a 4 MiB ring (one of them a stride-0 expansion of 4 bytes),
    and overwrites them in place as soon as they are returned."""

    def __init__(self):
        super().__init__()
        self.strided = Fn(lambda x: (x[:1] * 0 + torch.arange(float(3 << 20))).reshape(3, -1)[:, ::2])  # 6 MiB
        self.expanded = Fn(lambda x: (x[:1] * 0 + 7).expand(3 << 20))  # 12 MiB from one float
        self.small = Fn(lambda x: x + 1)
        self.seen = []

    def forward(self, x):
        seen = {}
        for name in ("strided", "expanded", "small"):
            out = getattr(self, name)(x)
            seen[name] = snapshot(out)
            scribble(out)
        self.seen.append(seen)
        return x * 2


@pytest.mark.parametrize("policy", ["block", "drop"])
def test_tensors_larger_than_the_ring_are_dumped_whole_under_block_and_skipped_under_drop(tmp_path, policy):
    model = Big()
    x = torch.arange(3.0)
    with fastdump.attach(model, tmp_path, ring_mb=4, policy=policy, root_name="big") as d:
        served = [model(x) for _ in range(2)]
    assert all(same_bits(s, x * 2) for s in served)
    assert d.stats()["dropped"] == 0
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped, skipped = ds.load("target", 0, p, check=True), skipped_of(ds, p)
        for name in ("small", "big"):
            assert same_bits(dumped[name], model.seen[p].get(name, x * 2)), (p, name)
        if policy == "block":
            assert skipped == {}
            for name in ("strided", "expanded"):
                assert same_bits(dumped[name], model.seen[p][name]), (p, name)
        else:  # drop never waits mid-tensor: these could never be staged whole
            assert "strided" not in dumped and "expanded" not in dumped
            assert "do not fit in the ring" in skipped["strided"] and "do not fit in the ring" in skipped["expanded"]
    assert not verify(tmp_path).problems


# -- two threads staging through one channel at once ----------------------------------------------

def test_two_threads_staging_large_strided_tensors_through_one_dumper_keep_each_tensors_bytes(tmp_path):
    """A copy of 64 KiB or more runs with the GIL released; another thread staging through the same
    Dumper meanwhile used to refill the channel's scratch shape and strides under it: the copy read
    the other tensor's layout (looping for minutes, or past its own tensor). The pass is mixed, and
    says so; each tensor in it must still be one of the two, whole, under its own name."""
    d = fastdump.attach(None, tmp_path)
    a = torch.arange(1024 * 256, dtype=torch.float32).reshape(1024, 256).t()  # [256, 1024], 1 MiB, strided
    b = -torch.arange(64 * 8192, dtype=torch.float32).reshape(64, 8192)[:, ::2]  # [64, 4096], strided
    want = {"a": a.contiguous(), "b": b.contiguous()}
    go = threading.Barrier(2)

    def stage(name):
        go.wait()
        for _ in range(40):
            d.dump(name, a if name == "a" else b)

    d.begin_pass()
    threads = [threading.Thread(target=stage, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a copy never finished"
    d.end_pass()
    stats = d.close()
    assert stats["tensors"] == 80 and stats["dropped"] == 0
    ds = fastdump.open(tmp_path)
    got = ds.load("target", 0, 0, check=True)
    assert len(got) == 80
    for name, t in got.items():
        assert same_bits(t, want[name[0]]), name


# -- models fastdump cannot wrap whole, and copies it must not run --------------------------------


def leaf_outputs(model, x) -> dict:
    """Run ``model`` once (no Dumper) and return {leaf name: a snapshot of what it returned} (one
    call each), taken by forward hooks that are gone again afterwards."""
    seen, handles = {}, []

    def keep_first(name, out) -> None:  # (a hook that returns a value replaces the output)
        seen.setdefault(name, snapshot(out))

    for name, module in model.named_modules():
        if name and next(iter(module.children()), None) is None and not isinstance(module, torch.jit.ScriptModule):
            handles.append(module.register_forward_hook(lambda m, args, out, name=name: keep_first(name, out)))
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    return dict(seen, __out__=snapshot(out))


class WithScripted(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.post = nn.Linear(4, 4), nn.Linear(4, 2)
        inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # children: inside TorchScript, never wrappable
        self.scripted = torch.jit.script(inner) if kind == "script" else torch.jit.trace(inner, torch.ones(1, 4))

    def forward(self, x):
        return self.post(self.scripted(self.pre(x)))


@pytest.mark.parametrize("kind", ["script", "trace"])
def test_a_scripted_or_traced_submodule_is_recorded_as_not_wrapped_and_the_rest_is_dumped(tmp_path, kind):
    """A ScriptModule's _modules is no dict: attach used to stop dumping at once ("'OrderedModuleDict'
    object has no attribute 'get'"). It and its submodules are left alone and recorded; the Python
    modules around it are dumped as usual."""
    from fastdump.capture import dumper as dumper_mod

    model = WithScripted(kind)
    x = torch.randn(3, 4)
    want = leaf_outputs(model, x)
    want["scripted"] = snapshot(model.scripted(want["pre"]))
    with fastdump.attach(model, tmp_path, root_name="root") as d:
        assert d.status == "running", d.error
        with torch.no_grad():
            served = [model(x) for _ in range(2)]
        assert not any(dumper_mod._is_ours(m.__dict__.get("forward")) for m in model.scripted.modules())
    assert all(same_bits(s, want["__out__"]) for s in served)  # the model's results, unchanged
    assert list(d.not_wrapped) == ["scripted"] and "TorchScript" in d.not_wrapped["scripted"]
    ds = fastdump.open(tmp_path)
    assert ds.rank_info("target", 0)["config"]["not_wrapped"] == d.not_wrapped
    for p in range(2):
        dumped = ds.load("target", 0, p, check=True)
        assert list(dumped) == ["pre", "post", "root"], p
        assert same_bits(dumped["pre"], want["pre"]) and same_bits(dumped["post"], want["post"])
        assert same_bits(dumped["root"], want["__out__"])
    assert not verify(tmp_path).problems


class BesideScripted(nn.Module):
    """A scripted ``enc`` beside Python modules whose names start with ``enc`` but are not inside it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        self.encoder = nn.Linear(4, 4)
        self.enc_head = nn.Sequential(nn.Linear(4, 2))

    def forward(self, x):
        return self.enc_head(self.encoder(self.enc(x)))


def test_a_module_whose_name_only_starts_with_a_scripted_ones_is_dumped(tmp_path):
    """Only what is inside a ScriptModule (``enc.*``) is left out with it: ``encoder`` and
    ``enc_head.0`` are Python modules beside it, dumped as usual (a prefix test without the dot
    would leave them silently missing)."""
    model = BesideScripted()
    x = torch.randn(3, 4)
    want = leaf_outputs(model, x)
    with fastdump.attach(model, tmp_path, root_name="root") as d:
        with torch.no_grad():
            model(x)
    assert list(d.not_wrapped) == ["enc"]
    dumped = fastdump.open(tmp_path).load("target", 0, 0, check=True)
    assert list(dumped) == ["encoder", "enc_head.0", "root"]
    assert same_bits(dumped["encoder"], want["encoder"]) and same_bits(dumped["enc_head.0"], want["enc_head.0"])
    assert same_bits(dumped["root"], want["__out__"])
    assert not verify(tmp_path).problems


@pytest.mark.parametrize("kind", ["script", "trace"])
def test_a_scripted_root_is_refused_before_any_directory_or_writer_exists(tmp_path, kind):
    """attach used to raise AttributeError after it had made the rank directory and opened a writer
    channel (``fastdump ls`` showed it running forever)."""
    from fastdump.capture import dumper as dumper_mod
    from fastdump.staging.engine import Engine

    plain = nn.Linear(4, 4)
    model = torch.jit.script(plain) if kind == "script" else torch.jit.trace(plain, torch.ones(1, 4))
    x = torch.randn(2, 4)
    want = snapshot(model(x))
    with pytest.raises(ValueError, match="ScriptModule"):
        fastdump.attach(model, tmp_path / "dump")
    assert not (tmp_path / "dump").exists()
    assert Engine._current is None or Engine._current.closed
    assert not list(dumper_mod._open_dumpers)
    assert not dumper_mod._is_ours(model.__dict__.get("forward")) and same_bits(model(x), want)


class PropertyForward(nn.Module):
    """A module whose class defines forward as a property (it picks an implementation per call)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @property
    def forward(self):
        return self._scaled

    def _scaled(self, x):
        return self.lin(x) * 2


class WithPropertyForward(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.prop, self.act = nn.Linear(4, 4), PropertyForward(), nn.SiLU()
        self.act.__class__ = type("SiLUByProperty", (nn.SiLU,), {"forward": property(lambda m: torch.tanh)})

    def forward(self, x):
        return self.act(self.prop(self.pre(x)))


@pytest.mark.parametrize("native", [True, False])
def test_a_module_whose_forward_is_a_property_is_recorded_as_not_wrapped(tmp_path, monkeypatch, native):
    """A property on the class hides the instance forward fastdump sets: the wrapper never ran and
    the module (a leaf: act) was silently missing from every pass, recorded nowhere. It is listed
    in not_wrapped with the reason; its submodules are dumped; watch() refuses it; close() leaves
    nothing behind."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_wrappers", native)
    model = WithPropertyForward()
    x = torch.randn(3, 4)
    with torch.no_grad():
        pre = snapshot(model.pre(x))
        lin = snapshot(model.prop.lin(pre))
        out = snapshot(model(x))
    with fastdump.attach(model, tmp_path, root_name="root") as d:
        with torch.no_grad():
            served = model(x)
        with pytest.raises(TypeError, match="property"):
            d.watch(model.prop, "prop")
    assert same_bits(served, out)
    assert sorted(d.not_wrapped) == ["act", "prop"] and "property" in d.not_wrapped["act"]
    ds = fastdump.open(tmp_path)
    assert ds.rank_info("target", 0)["config"]["not_wrapped"] == d.not_wrapped
    dumped = ds.load("target", 0, 0, check=True)
    assert list(dumped) == ["pre", "prop.lin", "root"]
    assert same_bits(dumped["pre"], pre) and same_bits(dumped["prop.lin"], lin) and same_bits(dumped["root"], out)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_root_name_that_reads_as_a_modules_name_is_refused_at_attach(tmp_path):
    """root_name="lm_head" dumped the root's output as ``lm_head`` and the LM head's as ``lm_head#1``,
    as if the head had run twice; root_name="model.final.0" made the tuple part of that name a
    recorded skip (lost). Both are refused before anything is created; a free name is kept."""
    model = WithScripted("script")
    for name in ("pre", "post", "pre.x", "scripted", "scripted.0"):
        with pytest.raises(ValueError, match="root_name"):
            fastdump.attach(model, tmp_path / "d", root_name=name)
        assert not (tmp_path / "d").exists()
    x = torch.randn(2, 4)
    with fastdump.attach(model, tmp_path / "d", root_name="prefix") as d:
        with torch.no_grad():
            out = model(x)
    assert d.status == "closed" and same_bits(fastdump.open(tmp_path / "d").load("target", 0, 0)["prefix"], out)


class WithParametrized(nn.Module):
    """weight_norm through torch.nn.utils.parametrize (as audio models use it): the Linear gets a
    ``parametrizations`` child, which computes its weight whenever the weight is read."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.norm(x)))


@pytest.mark.parametrize("native", [True, False])
def test_a_parametrized_module_is_dumped_as_the_leaf_it_is(tmp_path, monkeypatch, native):
    """A parametrized Linear has a child (its ParametrizationList), so it was no leaf: its output was
    missing from every pass, and only the weight its parametrization computed was dumped."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_wrappers", native)
    model = WithParametrized()
    x = torch.randn(3, 4)
    with torch.no_grad():
        weight = snapshot(model.norm.weight)
        norm = snapshot(model.norm(x))
        out = snapshot(model(x))
    with fastdump.attach(model, tmp_path, root_name="root"):
        with torch.no_grad():
            served = model(x)
    assert same_bits(served, out)
    dumped = fastdump.open(tmp_path).load("target", 0, 0, check=True)
    assert list(dumped) == ["norm.parametrizations.weight.0", "norm", "head", "root"]
    assert same_bits(dumped["norm"], norm) and same_bits(dumped["norm.parametrizations.weight.0"], weight)
    assert same_bits(dumped["root"], out)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not verify(tmp_path).problems


def _fake_replicate(monkeypatch):
    """torch's replicate() on the CPU: only its cross-GPU broadcast is replaced, by copies with
    doubled values (so that a replica's weights differ from the original's)."""
    import sys

    import torch.nn.parallel  # noqa: F401 - loads torch.nn.parallel.replicate

    rep = sys.modules["torch.nn.parallel.replicate"]
    monkeypatch.setattr(rep, "_broadcast_coalesced_reshape",
                        lambda tensors, devices, detach=False: [[t.detach() * 2 for t in tensors] for _ in devices])
    monkeypatch.setattr(rep, "_get_device_index", lambda d, *a, **k: 0)
    return rep.replicate


@pytest.mark.parametrize("native", [True, False])
def test_dataparallel_replicas_compute_with_their_own_weights_and_are_not_dumped(tmp_path, monkeypatch, native):
    """replicate() copies each module's __dict__, and our wrapper with it, which is bound to the
    original module: every replica computed with the original's weights (attach changed DataParallel's
    results). Replicas get the class's forward, as without fastdump; two of them run at once in two
    threads, as DataParallel runs them, without opening a pass; the original stays dumped."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_wrappers", native)
    replicate = _fake_replicate(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = [snapshot(r(x)) for r in replicate(model, [0, 1], detach=True)]
    want_model = leaf_outputs(model, x)
    assert not same_bits(want[0], want_model["__out__"])  # (the replicas' weights do differ)
    with fastdump.attach(model, tmp_path, root_name="root") as d:
        replicas = replicate(model, [0, 1], detach=True)
        got, go = [None, None], threading.Barrier(2)

        def run(i):
            go.wait()
            with torch.no_grad():
                got[i] = snapshot(replicas[i](x))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [same_bits(g, w) for g, w in zip(got, want)] == [True, True]
        assert d.pass_id == -1  # no replica's forward was a pass
        assert not any(any(a in m.__dict__ for a in ("forward", "__deepcopy__", "_replicate_for_data_parallel"))
                       for r in replicas for m in r.modules())  # as without fastdump
        with torch.no_grad():
            served = model(x)   # pass 0: the original, dumped as ever
    assert same_bits(served, want_model["__out__"])
    assert "_replicate_for_data_parallel" not in model.__dict__ and "forward" not in model[0].__dict__
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0]
    dumped = ds.load("target", 0, 0, check=True)
    assert list(dumped) == ["0", "1", "2", "root"]
    for name in ("0", "1", "2"):
        assert same_bits(dumped[name], want_model[name]), name
    assert same_bits(dumped["root"], want_model["__out__"])
    assert not verify(tmp_path).problems


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class LayeredNames(nn.Module):
    """Decoder layers at `layers.N` and at `model.layers.N`, and look-alikes that are no layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Block() for _ in range(3))
        self.xlayers = nn.ModuleList(Block() for _ in range(2))
        self.vision = nn.Module()
        self.vision.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for block in [*self.layers, *self.model.layers, *self.xlayers, *self.vision.layers]:
            x = block(x)
        return x


def test_layers_keeps_the_chosen_layers_at_layers_N_and_model_layers_N_and_no_other_name(tmp_path):
    """layers= used to filter model.layers.N only: a model whose decoder layers are top-level
    `layers.N` was dumped whole. Names that only look alike are no layers: kept."""
    model = LayeredNames()
    x = torch.randn(2, 4)
    want = leaf_outputs(model, x)
    with fastdump.attach(model, tmp_path, layers=[1], root_name="root"):
        with torch.no_grad():
            served = model(x)
    assert same_bits(served, want["__out__"])
    dumped = fastdump.open(tmp_path).load("target", 0, 0, check=True)
    assert list(dumped) == ["layers.1.fc", "model.layers.1.fc", "xlayers.0.fc", "xlayers.1.fc",
                            "vision.layers.0.fc", "vision.layers.1.fc", "root"]
    for name, t in dumped.items():
        assert same_bits(t, want["__out__" if name == "root" else name]), name


class ScaledBlock(nn.Module):
    """A module with a weight of its own and a child: parametrized, it has two children
    (``parametrizations`` and ``act``) and is still no leaf."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(x * self.weight)


class Doubled(nn.Module):
    def forward(self, w):
        return w * 2


class LinearOfMine(nn.Linear):
    """A subclass of a kept type (as MultiheadAttention's NonDynamicallyQuantizableLinear is)."""


class ParametrizedAndSubclassed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = ScaledBlock()
        nn.utils.parametrize.register_parametrization(self.block, "weight", Doubled())
        self.proj = LinearOfMine(4, 4)
        self._orig_mod = nn.Linear(4, 2)  # a child named so by its author: not torch.compile's level

    def forward(self, x):
        return self._orig_mod(self.proj(self.block(x)))


def test_a_parametrized_module_with_children_is_no_leaf_and_a_kept_types_subclass_is_kept(tmp_path):
    """Only a module whose one child is its ``parametrizations`` is a leaf (a parametrized Linear):
    ``block`` has ``act`` too, whose output is dumped, not block's. module_types=[nn.Linear] keeps
    a subclass of Linear. A child that its author named ``_orig_mod`` keeps that name (only a
    compiled wrapper's level is left out of names)."""
    model = ParametrizedAndSubclassed()
    x = torch.randn(2, 4)
    want = leaf_outputs(model, x)
    with fastdump.attach(model, tmp_path / "all", root_name="root"):
        with torch.no_grad():
            model(x)
    dumped = fastdump.open(tmp_path / "all").load("target", 0, 0, check=True)
    assert list(dumped) == ["block.parametrizations.weight.0", "block.act", "proj", "_orig_mod", "root"]
    for name in ("block.act", "proj", "_orig_mod"):
        assert same_bits(dumped[name], want[name]), name
    with fastdump.attach(model, tmp_path / "linear", root_name="root", module_types=[nn.Linear]):
        with torch.no_grad():
            model(x)
    dumped = fastdump.open(tmp_path / "linear").load("target", 0, 0, check=True)
    assert list(dumped) == ["proj", "_orig_mod"]
    assert same_bits(dumped["proj"], want["proj"]) and same_bits(dumped["_orig_mod"], want["_orig_mod"])


@pytest.mark.parametrize("kept", [nn.Linear, "Linear"])
def test_module_types_keeps_the_root_when_it_is_of_a_kept_type(tmp_path, kept):
    """module_types= never kept the root: attach(nn.Linear(..), module_types=[nn.Linear]) dumped
    empty passes. A root of another type is still left out."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    linear = nn.Linear(4, 4)
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    want_linear, want_seq = snapshot(linear(x)), leaf_outputs(seq, x)
    with fastdump.attach(linear, tmp_path / "linear", module_types=[kept]):
        with torch.no_grad():
            assert same_bits(linear(x), want_linear)
    with fastdump.attach(seq, tmp_path / "seq", module_types=[kept]):
        with torch.no_grad():
            assert same_bits(seq(x), want_seq["__out__"])
    dumped = fastdump.open(tmp_path / "linear").load("target", 0, 0, check=True)
    assert list(dumped) == ["Linear"] and same_bits(dumped["Linear"], want_linear)
    dumped = fastdump.open(tmp_path / "seq").load("target", 0, 0, check=True)
    assert list(dumped) == ["0", "2"]
    assert same_bits(dumped["0"], want_seq["0"]) and same_bits(dumped["2"], want_seq["2"])


class SharedRotary(nn.Module):
    """Every layer holds one cached rotary-like leaf (SGLang's get_rope, many HF ports), first
    registered under layer 0."""

    def __init__(self):
        super().__init__()
        rotary = nn.Tanh()
        self.layers = nn.ModuleList(nn.Module() for _ in range(3))
        for layer in self.layers:
            layer.fc = nn.Linear(4, 4)
            layer.rotary = rotary

    def forward(self, x):
        for layer in self.layers:
            x = layer.rotary(layer.fc(x))
        return x


@pytest.mark.parametrize("selection", [dict(layers=[1, 2]), dict(exclude=r"^layers\.0\.")])
def test_a_shared_leaf_whose_first_name_the_selection_leaves_out_is_recorded_not_silently_missing(
        tmp_path, caplog, selection):
    """A leaf held by every layer is wrapped once, under its first name (layers.0.rotary). With
    layers=[1, 2] that name is left out, so the leaf was not dumped at all, though the selection
    keeps layers.1.rotary and layers.2.rotary, and nothing said so. It is now in not_wrapped (and
    rank.json's config, and the log) with the reason; what is dumped is still bit-exact."""
    torch.manual_seed(0)
    model = SharedRotary()
    x = torch.randn(2, 4)
    want = leaf_outputs(model, x)
    with caplog.at_level("WARNING", logger="fastdump"):
        with fastdump.attach(model, tmp_path, root_name="root", **selection) as d:
            with torch.no_grad():
                model(x)
    assert list(d.not_wrapped) == ["layers.0.rotary"]
    assert "layers.1.rotary, layers.2.rotary" in d.not_wrapped["layers.0.rotary"]
    assert "not dumped" in d.not_wrapped["layers.0.rotary"]
    assert "layers.0.rotary" in caplog.text
    with fastdump.open(tmp_path) as ds:
        assert ds.rank_info("target", 0)["config"]["not_wrapped"] == d.not_wrapped
        dumped = ds.load("target", 0, 0, check=True)
    assert list(dumped) == ["layers.1.fc", "layers.2.fc", "root"]
    for name, t in dumped.items():
        assert same_bits(t, want["__out__" if name == "root" else name]), name


@pytest.mark.parametrize("selection", [dict(layers=[0]), dict()])
def test_a_shared_leaf_the_selection_keeps_under_its_first_name_is_not_recorded(tmp_path, selection):
    """Kept under its first name (layers.0.rotary), the shared leaf is wrapped there and each of
    its calls dumped as that name's (#1, #2 ...): nothing to record, with or without its other
    names kept too (no selection)."""
    torch.manual_seed(0)
    model = SharedRotary()
    x = torch.randn(2, 4)
    want = leaf_outputs(model, x)
    with fastdump.attach(model, tmp_path, root_name="root", **selection) as d:
        with torch.no_grad():
            out = model(x)
    assert d.not_wrapped == {}
    dumped = fastdump.open(tmp_path).load("target", 0, 0, check=True)
    kept = range(1) if selection else range(3)  # the fc layers kept; the rotary is called by every layer
    names = [n for i in range(3) for n in ((f"layers.{i}.fc",) if i in kept else ()) +
             ("layers.0.rotary" + (f"#{i}" if i else ""),)]
    assert list(dumped) == names + ["root"]
    assert same_bits(dumped["layers.0.rotary"], want["layers.0.rotary"]) and same_bits(dumped["root"], out)
    for i in kept:
        assert same_bits(dumped[f"layers.{i}.fc"], want[f"layers.{i}.fc"])


class _NonesOut(nn.Module):
    def forward(self, x):
        return (None, None)


class _DigitKeysOut(nn.Module):
    def forward(self, x):
        return {"0": x * 2, "1": x + 1}


def test_a_plain_pass_records_the_structure_of_outputs_whose_names_do_not_tell_it(tmp_path):
    """A pass with no metadata, no skip and no mixing still sends its structure record: a tuple of
    Nones stores nothing and a dict with digit keys reads as a tuple. (A mutant that took the one-call
    plain end whenever there was no meta, structure aside, lost the record; only passes with
    metadata were tested.)"""
    model = nn.Sequential(_NonesOut(), _DigitKeysOut())
    x = torch.randn(2, 3)
    d = fastdump.attach(model, tmp_path)
    d.begin_pass()  # (each child called on x: a pass without metadata)
    with torch.no_grad():
        model[0](x)
        out = model[1](x)
    d.end_pass()
    d.close()
    ds = fastdump.open(tmp_path)
    structure = ds.structure("target", None, 0)
    assert structure["0"]["kinds"] == {"": "tuple:empty"}, structure
    assert structure["1"]["kinds"] == {"": "dict"}, structure
    got = ds.load("target", None, 0)
    assert torch.equal(got["1.0"], out["0"]) and torch.equal(got["1.1"], out["1"])



class _EmptyOutputInOnePass(nn.Module):
    """first(x), then mid(x), which returns (None, None) in pass ``empty_in`` and a tensor in the
    others, then last(first's output)."""

    def __init__(self, empty_in: int):
        super().__init__()
        self.first, self.mid, self.last = nn.Linear(3, 3), _NonesOut(), nn.Linear(3, 2)
        self.plain_mid, self.empty_in, self.calls = nn.Identity(), empty_in, 0

    def forward(self, x):
        self.calls += 1
        h = self.first(x)
        (self.mid if self.calls - 1 == self.empty_in else self.plain_mid)(x)
        return self.last(h)


def test_a_structure_record_is_its_own_pass_s_and_places_an_empty_output_among_that_pass_s_tensors(tmp_path, kind):
    """Pass 1 of three holds an output that stores nothing, between the first leaf's tensor and the
    last one's: its record places it with ``after`` = 2 (tensors that pass stored after it returned:
    ``last`` and the root's output, whatever earlier passes stored), and the passes before and after it record no structure. (Mutants
    that kept the record into the next pass, counted ``after`` from the dump's start, or counted
    without the tensors the C++ lane had staged and not yet folded, survived the one-pass test.)"""
    model = _EmptyOutputInOnePass(empty_in=1)
    x = torch.randn(2, 3)
    with fastdump.attach(model, tmp_path, root_name="m"):
        with torch.no_grad():
            for _ in range(3):
                model(x)
    ds = fastdump.open(tmp_path)
    assert [ds.structure("target", None, p) for p in (0, 2)] == [{}, {}]
    assert ds.structure("target", None, 1) == {"mid": {"kinds": {"": "tuple:empty"}, "after": 2}}
    assert list(ds.load("target", None, 1)) == ["first", "last", "m"]
    assert list(ds.load("target", None, 2)) == ["first", "plain_mid", "last", "m"]
