"""A wide pass (a block per name: every module of a big model, MoE experts) reads back bit-exact
with a bounded number of HDF5 calls per block. HDF5 calls are counted, not timed: reading a
20k-name pass cost ~0.6 ms of h5py wrapping per block (12 s for `load`, ~24 s of a `diff`)."""

import collections
import shutil

import h5py
import pytest
import torch

import fastdump
from fastdump import reader

NAMES = 5000
SCALARS = 500  # scalar blocks: their one-row check scanned the whole index per block


def expected_pass(pass_id: int) -> dict:
    gen = torch.Generator().manual_seed(pass_id)
    tensors = {f"model.layers.{k // 15}.mlp.experts.{k % 15}": torch.randn(3, 5, generator=gen) for k in range(NAMES)}
    tensors.update({f"model.layers.{k}.router.aux_loss": torch.randn((), generator=gen).to(torch.bfloat16)
                    for k in range(SCALARS)})
    return tensors


@pytest.fixture(scope="module")
def wide_dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    dumper = fastdump.attach(None, root, role="target", writer="thread")
    for pass_id in range(2):
        dumper.begin_pass()
        for name, value in expected_pass(pass_id).items():
            dumper.dump(name, value)
        dumper.end_pass()
    assert dumper.close()["status"] == "closed"
    return root


def count_calls(monkeypatch, module, name: str) -> collections.Counter:
    counts = collections.Counter()
    real = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return counts


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


def assert_same(loaded: dict, expected: dict) -> None:
    assert list(loaded) == list(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape, name
        assert torch.equal(bits(loaded[name]), bits(value)), name


def test_a_wide_pass_loads_bit_exact_opening_each_block_and_attribute_once(wide_dump, monkeypatch):
    """Each block is opened once and each of its attributes once (h5py's ``attrs[name]`` after the
    size check opened every attribute twice, and ``h5file["blocks"]`` was opened again per block);
    a second pass of the same segment opens neither again: the checked blocks are kept."""
    ds = fastdump.open(wide_dump)
    ds.passes("target", 0)  # the segment's tables, outside the count
    attribute_opens = count_calls(monkeypatch, h5py.h5a, "open")
    object_opens = count_calls(monkeypatch, h5py.h5o, "open")
    assert_same(ds.load("target", 0, 0, check=True), expected_pass(0))
    blocks = NAMES + SCALARS
    # dtype, encoding, block_crc32c on each block, and scalar on the scalar ones
    assert attribute_opens["open"] == 3 * blocks + SCALARS
    assert object_opens["open"] <= blocks + 1  # each block, and the blocks group once
    attribute_opens.clear(), object_opens.clear()
    assert_same(ds.load("target", 0, 1), expected_pass(1))
    assert attribute_opens["open"] == 0 and object_opens["open"] == 0


def test_a_wide_pass_read_tensor_by_tensor_looks_each_name_up_once(wide_dump, monkeypatch):
    """``tensor()`` (what diff does for a pass over 64 MiB) scanned all the pass's index rows for
    each name: a pass of N names cost N x N comparisons. The lookup is a dict built once."""
    ds = fastdump.open(wide_dump)
    expected = expected_pass(1)
    names = list(expected)[::10]  # (the count says it: a scan per name)
    ds.tensor("target", 0, names[0], 1)
    scans = count_calls(monkeypatch, reader.SegmentIndex, "rows_of_pass")
    for name in names:
        assert_same({name: ds.tensor("target", 0, name, 1, check=True)}, {name: expected[name]})
    assert scans["rows_of_pass"] == 0
    with pytest.raises(KeyError, match="no tensor 'model.layers.0.mlp.experts.15' in pass 1"):
        ds.tensor("target", 0, "model.layers.0.mlp.experts.15", 1)


def test_verify_of_a_wide_pass_opens_each_block_and_each_attribute_once(wide_dump, monkeypatch, tmp_path):
    """verify read each block's attributes through h5py's ``attrs``: every attribute opened again
    after ``read_attrs`` had checked its size, twice per ``attrs.get``, and each block wrapped in
    h5py objects twice (~0.6 ms a block: 13 s of CPU for `verify --data` on a 22k-block pass, 8.6 s
    then). It reads them once, with the reader's low-level calls; a block is opened once, for its
    checks, and its rows are read at its offset (a second open and h5py's ``dataset[a:b]`` per
    block for --data cost ~0.3 ms a block: a third of `verify --data` on a 12k-block pass); none
    is held open (20k open datasets held ~280 MB)."""
    from fastdump.cli import dump as cli_dump

    with reader.open_segment(_only_segment(wide_dump)) as h5file:  # (one segment here)
        segment_attributes = len(h5file.attrs)
    attribute_opens = count_calls(monkeypatch, h5py.h5a, "open")
    object_opens = count_calls(monkeypatch, h5py.h5o, "open")
    report = cli_dump.verify_dump(str(wide_dump), read_data=True)
    assert report.problems == [] and report.warnings == []
    blocks = NAMES + SCALARS
    # dtype, encoding, block_crc32c on each block, scalar on the scalar ones, the segment's own once
    assert attribute_opens["open"] == 3 * blocks + SCALARS + segment_attributes
    assert blocks <= object_opens["open"] <= blocks + 16  # (+ the tables and groups)
    # ... and a changed block attribute still fails it: the attributes checked are those read.
    damaged = tmp_path / "damaged"
    shutil.copytree(wide_dump, damaged)
    with h5py.File(_only_segment(damaged), "r+") as h5file:
        h5file["blocks/7"].attrs["dtype"] = "float16"
    report = cli_dump.verify_dump(str(damaged))
    assert report.problems[0] == f"{_only_segment(damaged)} block 7: stored as float32, expected float16 for float16"


def _only_segment(root) -> str:
    import glob

    (path,) = glob.glob(f"{root}/target/*/seg-*.h5")
    return path


def test_a_wide_pass_holds_no_block_open_and_reads_each_pass_without_opening_a_block(wide_dump, monkeypatch):
    """Block handles were kept open in an LRU of ``_OPEN_BLOCKS`` (8192): HDF5 holds ~14 KB per open
    dataset (5500 blocks here: ~80 MB; a 12k-name diff: ~760 MB RSS), and a pass wider than the LRU
    closed and reopened every block of every pass (~0.5 ms a block). A checked block is now read at
    its offset: none is held open after its check, the next pass opens none, and the bits are the
    same, through ``load``, ``tensor`` and ``series``."""
    import gc

    gc.collect()  # (earlier tests' readers of the same file: HDF5 counts their datasets with ours)
    ds = fastdump.open(wide_dump)
    ds.passes("target", 0)
    (h5file,) = ds._files.values()
    before = h5py.h5f.get_obj_count(h5file.id, h5py.h5f.OBJ_DATASET)
    assert_same(ds.load("target", 0, 0, check=True), expected_pass(0))
    assert h5py.h5f.get_obj_count(h5file.id, h5py.h5f.OBJ_DATASET) == before
    attribute_opens = count_calls(monkeypatch, h5py.h5a, "open")
    object_opens = count_calls(monkeypatch, h5py.h5o, "open")
    assert_same(ds.load("target", 0, 1, check=True), expected_pass(1))
    assert_same({name: ds.tensor("target", 0, name, 1) for name in list(expected_pass(1))[::500]},
                {name: value for name, value in list(expected_pass(1).items())[::500]})
    name = "model.layers.3.router.aux_loss"  # (a scalar block: 0-d tensors)
    series = ds.series("target", 0, name, check=True)
    assert_same({p: series[p] for p in (0, 1)}, {p: expected_pass(p)[name] for p in (0, 1)})
    assert attribute_opens["open"] == 0 and object_opens["open"] == 0
    assert h5py.h5f.get_obj_count(h5file.id, h5py.h5f.OBJ_DATASET) == before
