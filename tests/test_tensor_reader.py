"""The torch-aware tensor reader (fastdump._torch_reader): the hot path's facts from the TensorImpl.

Whatever it reads must be what the Python attributes say, and what it stages must be byte for byte
what the attribute path stages; what it declines (subclasses, other layouts and devices, lazy bits)
must reach the attribute path unchanged.
"""

import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

import fastdump
from fastdump import _C, dtypes
from fastdump.staging import tensor_reader

try:
    from fastdump import _torch_reader
except ImportError as exc:  # CI builds it (.ci/run checks); a build without torch at build time has none
    _torch_reader = None
    _WHY = f"fastdump._torch_reader not built here ({exc}); install with pip install --no-build-isolation"

needs_reader = pytest.mark.skipif(_torch_reader is None, reason=_WHY if _torch_reader is None else "")

FAST_CODES = {getattr(torch, n): (dtypes.CODE_BY_NAME[n], getattr(torch, n).itemsize)
              for n in dtypes.NAMES if isinstance(getattr(torch, n, None), torch.dtype)
              and not getattr(torch, n).is_complex}
_names = itertools.count()


@contextlib.contextmanager
def reader(on: bool):
    """The process-wide reader on or off for the block, restored after."""
    before = _C.tensor_reader() is not None
    _C.set_tensor_reader(_torch_reader.READER if on else None)
    try:
        yield
    finally:
        _C.set_tensor_reader(_torch_reader.READER if before else None)


def ring():
    name = f"/fastdump-{os.getpid()}-reader{next(_names)}"
    producer = _C.Producer(name, 1 << 22, 0)
    consumer = _C.Consumer(name)
    producer.unlink()
    return producer, consumer


def stage_all(tensors, on: bool):
    """stage_tensor on each tensor with the reader on or off: statuses, records, counts."""
    producer, consumer = ring()
    lane = _C.ChannelStager(producer, 0, FAST_CODES, torch.strided)
    lane.begin(3, True, 5.0)
    statuses, records = [], []
    with reader(on):
        for i, t in enumerate(tensors):
            try:
                statuses.append(lane.stage_tensor(i, t))
            except Exception as exc:  # the attribute path raises on some (the Dumper's caller absorbs it)
                statuses.append(type(exc).__name__)
    while (rec := consumer.next(0.05)) is not None:
        _kind, _ch, name_id, pass_id, code, shape, payload, *_ = rec
        records.append((name_id, pass_id, code, tuple(shape), bytes(payload)))
        consumer.release()
    return statuses, records, lane.take_counts()


def plain_tensors():
    """Dense strided CPU tensors of every fast dtype and the layouts models produce."""
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    out = [
        base, base.transpose(1, 3), base[:, 1:, ::2], base[1], base[0, 0, 0, 0],  # 0-d view with an offset
        torch.tensor(3.5), torch.empty(0, 4), torch.empty(3, 0)[1:],  # empty, offset past the end
        torch.randn(4, 1).expand(4, 6),  # stride 0
        base.contiguous(memory_format=torch.channels_last),
        torch.nn.Parameter(torch.randn(3, 3)),  # treated as a Tensor by torch's C++ too
        torch.randn(5, requires_grad=True) * 2,  # carries autograd history
        torch.ones([1] * 32),  # as many dims as the ring takes
    ]
    for dtype in FAST_CODES:  # random bytes viewed as each dtype (fp8/fp4 have no casts on the CPU)
        if dtype == torch.bool:
            t = torch.randn(3, 7) > 0
        else:
            t = torch.randint(0, 256, (3, 7 * dtype.itemsize), dtype=torch.uint8).view(dtype)
        out += [t, t.t()]
    return out


@needs_reader
def test_reader_is_built_for_the_running_torch():
    assert _torch_reader.TORCH_VERSION == str(torch.__version__)
    state = tensor_reader.install()
    assert state["reader"] == "torch" and state["torch"] == str(torch.__version__), state
    assert _C.tensor_reader() == str(torch.__version__)


@needs_reader
def test_reader_reads_what_the_attributes_say():
    with reader(True):
        for t in plain_tensors():
            facts = _C.read_tensor_facts(t)
            assert facts is not None, t.shape
            device, _scalar_type, shape, strides, ptr = facts
            assert (device, shape, strides) == ("cpu", tuple(t.shape), t.stride())
            if t.numel():
                assert ptr == t.data_ptr()


@needs_reader
def test_reader_stages_byte_for_byte_what_attribute_reads_stage():
    tensors = plain_tensors()
    with_reader, without = stage_all(tensors, True), stage_all(tensors, False)
    assert with_reader == without
    statuses, records, counts = with_reader
    assert statuses == [_C.STAGED] * len(tensors)
    assert counts == (len(tensors), sum(t.numel() * t.element_size() for t in tensors))
    for t, (name_id, pass_id, code, shape, payload) in zip(tensors, records):
        assert (pass_id, code, shape) == (3, FAST_CODES[t.dtype][0], tuple(t.shape))
        assert payload == c_order_bytes(t), name_id


def c_order_bytes(t):
    """t's elements' bytes in C order, gathered from its storage (many dtypes have no CPU copy kernel)."""
    size = t.element_size()
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    view = raw.as_strided([*t.shape, size], [s * size for s in t.stride()] + [1], t.storage_offset() * size)
    return view.contiguous().numpy().tobytes()


def nested_tensor(parts):
    with warnings.catch_warnings():  # "prototype stage": the strided nested layout is the C++ one
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor(parts)


class Tagged(torch.Tensor):
    """A subclass without Python dispatch: a plain TensorImpl under a Python type."""

    @property
    def shape(self):  # what it says is not what its memory holds
        return torch.Size([1 << 20])


@needs_reader
def test_reader_reads_a_subclass_from_its_tensor_impl_not_its_python_attributes():
    base = torch.arange(12.0)
    t = base[2:8].reshape(2, 3).t().as_subclass(Tagged)
    with reader(True):
        assert _C.read_tensor_facts(t) == ("cpu", 6, (3, 2), (1, 3), base.data_ptr() + 2 * 4)


@needs_reader
def test_reader_declines_what_it_must_not_read():
    z = torch.randn(3, dtype=torch.complex64)
    declined = [
        torch.randn(4, 4).to_sparse(),
        torch.empty(3, device="meta"),
        z.conj().imag,  # the lazy negation bit
        z.conj(),  # the lazy conjugation bit
        nested_tensor([torch.randn(2), torch.randn(3)]),
        torch.ones([1] * 33),
        "not a tensor",
    ]
    with reader(True):
        for t in declined:
            assert _C.read_tensor_facts(t) is None, t
    # What the reader declines goes the attribute path's way: the same statuses with it as without.
    staged = declined[:-2]
    assert stage_all(staged, True) == stage_all(staged, False)


@needs_reader
def test_reader_refuses_a_tensor_its_storage_does_not_hold():
    """A storage freed or shrunk under its tensor (``untyped_storage().resize_``, as FSDP does): the
    reader says so (-1), and stage_tensor raises instead of reading past the allocation."""
    freed, shrunk, whole = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    freed.untyped_storage().resize_(0)
    shrunk.untyped_storage().resize_(60)  # one float short of the 16
    last_row = whole[3:]  # ends exactly where the storage ends
    with reader(True):
        assert _C.read_tensor_facts(freed) == "storage short"
        assert _C.read_tensor_facts(shrunk) == "storage short"
        assert _C.read_tensor_facts(last_row)[2] == (1, 4)
        assert _C.read_tensor_facts(shrunk[:3, :3]) is not None  # the view's own elements are all there
    assert stage_all([freed, shrunk], True)[0] == ["ValueError", "ValueError"]
    assert stage_all([freed], False)[0] == ["ValueError"]  # the attribute path sees the null pointer
    statuses, records, _ = stage_all([last_row, shrunk[:3, :3]], True)
    assert statuses == [_C.STAGED] * 2 and records[0][4] == c_order_bytes(last_row)


@needs_reader
def test_tensor_reader_falls_back_when_the_extension_cannot_load(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastdump._torch_reader", None)  # import raises ImportError
    state = tensor_reader._probe()
    assert state["reader"] == "attributes" and "unavailable" in state["why"]
    monkeypatch.setenv("FASTDUMP_TORCH_READER", "0")
    assert tensor_reader._probe()["why"] == "FASTDUMP_TORCH_READER=0"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).t()  # a transposed root output


_END_TO_END = """
import sys, torch, fastdump
from fastdump.staging import tensor_reader
sys.path.insert(0, {tests!r})
from test_tensor_reader import Block
torch.manual_seed(0)
model, x = Block(), torch.randn(4, 8)
with torch.no_grad(), fastdump.attach(model, {root!r}) as d:
    outs = [model(x * i) for i in range(3)]
    print(tensor_reader.describe()["reader"])
ds = fastdump.open({root!r})
for i, out in enumerate(outs):
    got = ds.load("target", 0, i, check=True)
    assert sorted(got) == ["Block", "a", "b"] and torch.equal(got["Block"], out), i
    assert torch.equal(got["b"], out.t()) and torch.equal(got["a"], model.a(x * i)), i
print("ok")
"""


@pytest.mark.parametrize("env, want", [({}, "torch"), ({"FASTDUMP_TORCH_READER": "0"}, "attributes")])
def test_dump_is_the_same_with_and_without_the_reader(env, want):
    """A whole dump, in a fresh process so the reader is (or is not) installed from the start."""
    if want == "torch" and _torch_reader is None:
        pytest.skip(_WHY)
    with tempfile.TemporaryDirectory() as root:
        code = _END_TO_END.format(tests=os.path.dirname(__file__), root=root)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        lines = out.stdout.split("\n")
        assert lines[0] == want and lines[1].startswith("ok"), out.stdout
