"""End to end on CPU: what is dumped equals what the model computed when each module returned."""

import asyncio
import gc
import json
import os
import signal
import sys
import time

import pytest
import torch

import fastdump
from fastdump import dtypes
from fastdump.cli import dump as cli_dump
from toy_models import LeafReference, TinyDraft, TinyLM
from conftest import read_rank_json, require_o_direct, same_bits


def assert_pass_equal(dumped: dict, reference: list, extra=()):
    names = [n for n in dumped if n not in extra]
    assert names == [n for n, _ in reference]
    for name, want in reference:
        assert same_bits(dumped[name], want), name


def run_eagle(target, draft, steps=3, k=2, ref_t=None, ref_d=None):
    """Prefill, then rounds of k draft passes and one target verify pass. Returns every output."""
    run_t = ref_t or target
    run_d = ref_d or (lambda *a: draft(*a))
    outs = []
    with torch.inference_mode():
        tcache, dcache = target.new_cache(), {"k": [], "v": []}
        ids = torch.tensor([[3, 14, 15, 92, 65]])
        logits = run_t(ids, tcache)
        outs.append(logits)
        hidden = torch.zeros(1, 1, target.model.embed.embedding_dim)
        tok = logits[:, -1:].argmax(-1)
        for _ in range(steps):
            drafted = []
            for _ in range(k):
                dl, hidden = run_d(tok, hidden, dcache)
                outs += [dl, hidden]
                tok = dl.argmax(-1)
                drafted.append(tok)
            logits = run_t(torch.cat(drafted, 1), tcache)
            outs.append(logits)
            tok = logits[:, -1:].argmax(-1)
    return outs


def test_two_roles_every_leaf_bit_exact_and_outputs_unchanged(tmp_path):
    target = TinyLM()
    draft = TinyDraft(target)
    plain = run_eagle(target, draft)

    ref_t, ref_d = LeafReference(target), LeafReference(draft)
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft")
    dumped_run = run_eagle(target, draft, ref_t=ref_t, ref_d=ref_d)
    assert dt.close()["status"] == "closed" and dd.close()["status"] == "closed"
    ref_t.remove()
    ref_d.remove()

    # The model computed exactly the same thing with fastdump attached.
    assert all(same_bits(a, b) for a, b in zip(plain, dumped_run))

    ds = fastdump.open(tmp_path)
    assert ds.roles == ["draft", "target"]
    assert ds.passes("target", 0) == list(range(len(ref_t.passes)))
    assert ds.passes("draft", 0) == list(range(len(ref_d.passes)))
    for role, ref, root in (("target", ref_t, "TinyLM"), ("draft", ref_d, "TinyDraft")):
        for pass_id, reference in enumerate(ref.passes):
            dumped = ds.load(role, 0, pass_id)
            root_names = {n for n in dumped if n == root or n.startswith(root + ".")}
            assert root_names, "the root's output is dumped too"
            assert_pass_equal(dumped, reference, extra=root_names)
    # Spot checks of the awkward cases inside the toy model.
    first = ds.load("target", 0, 0)
    assert "model.stats.mean" in first and "model.stats#1.max" in first     # dict output, repeated call
    assert "model.final.0" in first                                        # leaf called with .forward()
    # The residual that later kernels overwrite in place was captured before they ran.
    assert not same_bits(first["model.layers.0.norm1.1"], first["model.layers.0.norm2.1"])
    # Every pass holds the model's own output, in the same pass as the LM head that made it.
    for pass_id, logits in enumerate(o for i, o in enumerate(dumped_run) if i % 5 == 0):
        dumped = ds.load("target", 0, pass_id)
        assert same_bits(dumped["TinyLM"], logits) and same_bits(dumped["lm_head"], logits)


def test_inputs_are_captured_before_forward_mutates_them(tmp_path):
    target = TinyLM(layers=1)
    with fastdump.attach(target, tmp_path, include=r"norm1$", inputs=True):
        with torch.inference_mode():
            ids = torch.tensor([[1, 2, 3]])
            x = target.model.embed(ids)
            target(ids, target.new_cache())
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert list(dumped) == ["model.layers.0.norm1.input.0", "model.layers.0.norm1.input.1",
                            "model.layers.0.norm1.0", "model.layers.0.norm1.1"]
    assert same_bits(dumped["model.layers.0.norm1.input.0"], x)
    assert same_bits(dumped["model.layers.0.norm1.input.1"], torch.zeros_like(x))  # before residual.add_
    assert same_bits(dumped["model.layers.0.norm1.1"], x)                           # after


@pytest.mark.parametrize("options, present, absent", [
    (dict(layers=[1]), ["model.layers.1.mlp.up", "model.embed", "lm_head"], ["model.layers.0.mlp.up", "model.layers.2.attn.o"]),
    (dict(include=r"\.mlp\."), ["model.layers.0.mlp.down"], ["model.embed", "lm_head", "TinyLM"]),
    (dict(exclude=r"attn|stats"), ["model.layers.2.mlp.act"], ["model.layers.0.attn.qkv", "model.stats.mean"]),
    (dict(exclude=r"^TinyLM$"), ["lm_head", "model.embed"], ["TinyLM"]),  # the root too (selection.root_selected)
    (dict(module_types=[torch.nn.SiLU]), ["model.layers.0.mlp.act"], ["lm_head", "TinyLM"]),
    (dict(module_types=["Embedding"]), ["model.embed"], ["lm_head"]),
])
def test_module_selection(tmp_path, options, present, absent):
    target = TinyLM()
    with fastdump.attach(target, tmp_path, **options), torch.inference_mode():
        target(torch.tensor([[1, 2]]), target.new_cache())
    names = list(fastdump.open(tmp_path).load("target", 0, 0))
    assert all(n in names for n in present), names
    assert not any(n in names for n in absent), names


@pytest.mark.parametrize("options, expected", [
    (dict(skip_passes=2), [2, 3, 4, 5, 6, 7]),
    (dict(every=3), [0, 3, 6]),
    (dict(skip_passes=1, every=2), [1, 3, 5, 7]),
    (dict(pass_range=(2, 5)), [2, 3, 4]),
])
def test_pass_selection(tmp_path, options, expected):
    lin = torch.nn.Linear(4, 4)
    with fastdump.attach(lin, tmp_path, **options), torch.inference_mode():
        xs = [torch.randn(1, 4) for _ in range(8)]
        ys = [lin(x) for x in xs]
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == expected
    for p in expected:
        assert same_bits(ds.load("target", 0, p)["Linear"], ys[p])


def test_byte_budget_stops_dumping_and_is_recorded(tmp_path):
    lin = torch.nn.Linear(256, 256)
    with fastdump.attach(lin, tmp_path, max_bytes=3 * 1024) as d, torch.inference_mode():
        for _ in range(10):
            lin(torch.randn(1, 256))  # 1 KiB per pass
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    assert d.stats()["passes"] == 3
    assert ds.rank_info("target", 0)["budget_reached"] is True


def test_stats_count_what_the_cpp_hot_path_staged(tmp_path):
    """Issue 11: plain CPU tensors are staged and counted in C++ (ChannelStager.stage_tensor); the
    Dumper's stats, mid-pass and at close, and the writer's record still count every one."""
    a, b = torch.randn(3, 4), torch.randn(5, dtype=torch.float64)
    with fastdump.attach(None, tmp_path) as d:
        d.begin_pass()
        d.dump("a", a)      # first use of a name: the general path
        d.dump("b", b)
        assert (d.stats()["tensors"], d.stats()["bytes"]) == (2, a.nbytes + b.nbytes)
        d.end_pass()
        for _ in range(3):
            d.begin_pass()
            d.dump("a", a)  # a known name: the C++ path
            d.dump("b", b)
            d.dump("c", a.t())
            assert d.stats()["tensors"] == 2 + 3 * d.stats()["passes"]  # this pass's three included
            d.end_pass()
    stats = d.stats()
    assert (stats["tensors"], stats["bytes"]) == (11, 4 * (a.nbytes + b.nbytes) + 3 * a.nbytes)
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2, 3]
    assert same_bits(ds.load("target", 0, 3)["c"], a.t().contiguous())
    assert ds.rank_info("target", 0)["tensors"] == 11


def test_stats_count_the_tensors_of_the_general_path_too(tmp_path):
    """Lazy conj/neg views are resolved into a copy and staged through the general path
    (Channel.stage), whose STAGED status the Dumper counts itself (_account): stats() counts them
    as the writer stores them (a mutant that left that count out said 0 tensors for 6 stored)."""
    z = torch.complex(torch.randn(3), torch.randn(3))
    with fastdump.attach(None, tmp_path) as d:
        for _ in range(2):
            with d.manual_pass():
                d.dump("conj", z.conj())
                d.dump("neg", z.conj().imag)
                d.dump("zeros", torch.zeros(2, dtype=torch.complex64))
    stats = d.stats()
    assert (stats["tensors"], stats["bytes"]) == (6, 2 * (z.nbytes + z.imag.nbytes + 16)), stats
    ds = fastdump.open(tmp_path)
    assert sum(len(ds.load("target", 0, p)) for p in ds.passes("target", 0)) == 6
    assert same_bits(ds.load("target", 0, 1)["conj"], z.conj().resolve_conj())


def test_every_dtype_round_trips_bit_exact(tmp_path):
    torch.manual_seed(0)
    values = {}
    for name in dtypes.NAMES:
        dtype = getattr(torch, name)
        raw = torch.randint(0, 256, (3, 5 * dtypes.ITEMSIZE[dtypes.CODE_BY_NAME[name]]), dtype=torch.uint8)
        if name == "bool":
            values[name] = raw[:, :5] % 2 == 1
        else:
            values[name] = raw.view(dtype)  # every bit pattern: NaN payloads, -0.0, subnormals
    values["float32_special"] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])
    with fastdump.attach(None, tmp_path) as d:
        d.begin_pass(kind="dtypes")
        for name, t in values.items():
            d.dump(name, t)
        d.dump("q", torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8))
        d.end_pass()
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    for name, t in values.items():
        assert same_bits(dumped[name], t), name
    assert "q" not in dumped
    meta = ds.meta("target", 0, 0)
    assert meta["kind"] == "dtypes"
    assert any(s["name"] == "q" and "quantized" in s["reason"] for s in meta["skipped"])


def test_awkward_shapes_and_layouts(tmp_path):
    base = torch.randn(6, 8)
    values = {
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "empty_inner": torch.empty(4, 0),
        "transposed": base.t(),
        "sliced": base[1::2, ::3],
        "expanded": torch.randn(3, 1).expand(3, 5),
        "high_rank": torch.randn(2, 1, 3, 1, 2, 1, 2),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "neg_stride": base.flip(1),
    }
    with fastdump.attach(None, tmp_path) as d:
        for shape_change in (0, 1):  # the second pass changes trailing shapes (per-pass fallback)
            d.begin_pass()
            for name, t in values.items():
                d.dump(name, t if not shape_change else torch.cat([t.reshape(-1), t.reshape(-1)]))
            d.dump("nothing", None)  # not tensor data: ignored, no error
            d.end_pass()
    ds = fastdump.open(tmp_path)
    for p in (0, 1):
        dumped = ds.load("target", 0, p)
        for name, t in values.items():
            want = t if not p else torch.cat([t.reshape(-1), t.reshape(-1)])
            assert same_bits(dumped[name], want.resolve_conj()), (p, name)


def test_tensor_larger_than_the_ring_is_split(tmp_path):
    big = torch.randn(3, 700, 1000)[:, :, ::2]  # 4.2 MB strided, ring 1 MiB
    with fastdump.attach(None, tmp_path, ring_mb=1) as d:
        d.dump("big", big)
    assert same_bits(fastdump.open(tmp_path).load("target", 0, 0)["big"], big)


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_large_tensors_go_straight_from_the_ring_into_the_segment(tmp_path, writer):
    # >= 1 MiB: written into the open segment file from shared memory (one copy), mixed with
    # small buffered tensors, across a rotation, with shapes that change between passes.
    torch.manual_seed(0)
    passes = [{"big": torch.randn(512 + p, 1024), "small": torch.randn(3, 4),
               "big_bf16": torch.randn(4, 256, 512).to(torch.bfloat16)[:, ::2]} for p in range(5)]
    with fastdump.attach(None, tmp_path, writer=writer, segment_passes=2) as d:
        for values in passes:
            d.begin_pass()
            for name, t in values.items():
                d.dump(name, t)
            d.end_pass()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2, 3, 4]
    for p, values in enumerate(passes):
        dumped = ds.load("target", 0, p)
        assert list(dumped) == list(values)
        for name, t in values.items():
            assert same_bits(dumped[name], t), (p, name)
    assert len(read_rank_json(tmp_path / "target" / ds.ranks("target")[0])["segments"]) == 3
    assert not list(tmp_path.glob("target/*/.*tmp"))  # no temporary file left behind
    import subprocess, sys
    assert subprocess.run([sys.executable, "-m", "fastdump", "verify", str(tmp_path)]).returncode == 0


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_tensor_split_into_chunks_that_arrive_as_ring_views(tmp_path, writer):
    # ring 8 MiB -> 2 MiB chunks: each chunk is large enough to reach the writer as a view into
    # the ring, which must be released even though the tensor is not complete yet.
    big = torch.randn(5 << 18)  # 5 MiB: three chunks
    with fastdump.attach(None, tmp_path, ring_mb=8, writer=writer) as d:
        for i in range(3):
            d.dump(f"big{i}", big + i)
    stats = d.stats()
    assert stats["status"] == "closed", stats["error"]
    ds = fastdump.open(tmp_path)
    for i in range(3):
        assert same_bits(ds.load("target", 0, i)[f"big{i}"], big + i)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
@pytest.mark.parametrize("priority,policy", [("idle", "SCHED_IDLE"), ("normal", "SCHED_OTHER")])
def test_writer_process_priority(tmp_path, priority, policy):
    x = torch.arange(6.0)
    with fastdump.attach(None, tmp_path, writer_priority=priority) as d:
        writer = d._engine._proc
        # (it lowers itself right after it acks the open attach waited for: tests/test_writer_priority.py)
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(writer.pid) != getattr(os, policy) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.sched_getscheduler(writer.pid) == getattr(os, policy)
        d.dump("x", x)
    assert same_bits(fastdump.open(tmp_path).load("target", 0, 0)["x"], x)
    assert d.stats()["status"] == "closed"


def test_writer_process_shares_the_session_but_not_the_process_group(tmp_path):
    # Same session: Linux schedules a session as one group (autogroup), so a writer in a session
    # of its own would compete with the model as an equal and SCHED_IDLE would not hold.
    # Own process group: Ctrl-C in the serving terminal (SIGINT to the foreground group) does not
    # reach it, and the writer ignores SIGINT anyway.
    with fastdump.attach(None, tmp_path) as d:
        writer = d._engine._proc
        assert os.getsid(writer.pid) == os.getsid(0)
        assert os.getpgid(writer.pid) == writer.pid != os.getpgid(0)
        os.kill(writer.pid, signal.SIGINT)
        d.dump("x", torch.arange(3))
    assert d.stats()["status"] == "closed"
    assert same_bits(fastdump.open(tmp_path).load("target", 0, 0)["x"], torch.arange(3))


def test_bad_writer_priority_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="writer_priority must be 'idle' or 'normal'"):
        fastdump.attach(None, tmp_path, writer_priority="realtime")


def test_large_tensors_go_from_the_ring_to_disk_with_o_direct(tmp_path, o_direct_bytes):
    require_o_direct(tmp_path)
    direct = o_direct_bytes  # the thread writer runs in this process, so the recording sees it
    gen = torch.Generator().manual_seed(1)
    sent = [torch.randn((1 << 18) + 1001 * i, generator=gen) for i in range(4)]  # 1 MiB + odd tails
    with fastdump.attach(None, tmp_path, writer="thread", ring_mb=8) as d:
        for i, t in enumerate(sent):
            d.begin_pass()
            d.dump("small", torch.full((3,), float(i)))  # shifts the big one's place in the ring
            d.dump("big", t)
            d.end_pass()
    assert d.stats()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    for i, t in enumerate(sent):
        assert same_bits(ds.load("target", 0, i)["big"], t)
    # Everything but each tensor's last partial page went around the page cache.
    assert sum(direct) == sum(t.nbytes - t.nbytes % 4096 for t in sent)


def test_drop_policy_counts_every_dropped_tensor(tmp_path):
    with fastdump.attach(None, tmp_path, ring_mb=1, policy="drop") as d:
        writer = d._engine._proc
        os.kill(writer.pid, signal.SIGSTOP)  # a stalled writer: the ring fills
        try:
            d.begin_pass()
            for i in range(400):
                d.dump(f"t{i}", torch.full((1024,), float(i)))  # 4 KiB each, 1.6 MiB > ring
            d.end_pass()
        finally:
            os.kill(writer.pid, signal.SIGCONT)
    stats = d.stats()
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    assert stats["dropped"] > 0
    assert len(dumped) + stats["dropped"] == 400
    for name, t in dumped.items():
        assert same_bits(t, torch.full((1024,), float(name[1:])))
    assert ds.meta("target", 0, 0)["dropped"] == stats["dropped"]
    assert ds.rank_info("target", 0)["dropped"] == stats["dropped"]



def test_drop_policy_counts_every_pass_dropped_at_its_start(tmp_path):
    """Under `drop`, a pass whose begin finds the ring full is dropped whole: each one is counted
    (stats, rank.json, verify's warning), so the passes on disk plus the dropped ones are all passes."""
    n = 400  # 64 KiB each, 25 MiB in all: the 1 MiB ring fills, then even pass starts find no room
    with fastdump.attach(None, tmp_path, ring_mb=1, policy="drop") as d:
        writer = d._engine._proc
        os.kill(writer.pid, signal.SIGSTOP)  # a stalled writer: the ring fills
        try:
            for i in range(n):
                d.begin_pass()
                d.dump("t", torch.full((16384,), float(i)))
                d.end_pass()
        finally:
            os.kill(writer.pid, signal.SIGCONT)
        last = d.pass_id
    stats = d.stats()
    assert last == n - 1
    ds = fastdump.open(tmp_path)
    stored = ds.passes("target", 0)
    assert 0 < stats["dropped_passes"] < n
    assert len(stored) + stats["dropped_passes"] == n
    assert ds.rank_info("target", 0)["dropped_passes"] == stats["dropped_passes"]
    assert sum(1 for p in stored if "t" in ds.load("target", 0, p)) + stats["dropped"] == len(stored)
    for p in stored:
        got = ds.load("target", 0, p)
        assert "t" not in got or same_bits(got["t"], torch.full((16384,), float(p)))
    report = cli_dump.verify_dump(str(tmp_path))
    assert not report.problems
    assert any(f"{stats['dropped_passes']} whole pass(es) were dropped" in w for w in report.warnings), report.warnings



class _ManyOutputs(torch.nn.Module):
    """A leaf returning ``n`` tensors like ``x``; its root returns a one-element slice of ``x``."""

    def forward(self, x, n):
        return tuple(x + i for i in range(n))


class _RootOfMany(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.many = _ManyOutputs()

    def forward(self, x, n):
        self.many(x, n)
        return x[:1]


@pytest.mark.parametrize("native_pass", [True, False])
def test_a_pass_after_one_with_drops_counts_only_its_own(tmp_path, monkeypatch, native_pass):
    """Under `drop`, pass 0 (64 tensors of 16 KiB: more than the 1 MiB ring) drops tensors while the
    writer is stopped; once the writer has caught up, pass 1 (4 tensors) drops none and its end says
    0: each pass's begin resets the channel's per-pass drop count, the C root pass's too (a mutant
    whose C begin left it carried pass 0's drops into pass 1, which then read as missing tensors)."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native_pass)
    model = _RootOfMany()
    x = torch.zeros(4096)
    with fastdump.attach(model, tmp_path, ring_mb=1, policy="drop", root_name="root") as d, torch.no_grad():
        writer = d._engine._proc
        os.kill(writer.pid, signal.SIGSTOP)
        try:
            model(x, 64)
        finally:
            os.kill(writer.pid, signal.SIGCONT)
        stats = d.stats()
        assert stats["dropped"] > 0 and stats["lost_pass_ends"] == 0, stats
        assert d._engine.wait_acked(d._unconfirmed[-1], 30)  # pass 0's end handled: the ring is free
        model(x + 1, 4)
    stats = d.stats()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1]
    assert ds.meta("target", 0, 0)["dropped"] == stats["dropped"]
    assert ds.meta("target", 0, 1)["dropped"] == 0
    assert list(ds.load("target", 0, 1)) == ["many.0", "many.1", "many.2", "many.3", "root"]
    assert not cli_dump.verify_dump(str(tmp_path)).problems

def test_manual_passes_and_metadata(tmp_path):
    lin = torch.nn.Linear(2, 2)
    with fastdump.attach(lin, tmp_path) as d, torch.inference_mode():
        d.set_pass_meta(forward_mode="prefill", batch_size=1)
        lin(torch.randn(1, 2))
        d.begin_pass(forward_mode="decode")      # two root calls in one pass
        lin(torch.randn(1, 2))
        d.begin_pass(step="inner")               # nested: its metadata joins the open pass
        lin(torch.randn(1, 2))
        d.end_pass()
        d.set_pass_meta(tokens=[1, 2])
        d.end_pass()
        d.dump("outside", torch.ones(2))        # outside any pass: a pass of its own
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    assert ds.meta("target", 0, 0)["forward_mode"] == "prefill"
    meta = ds.meta("target", 0, 1)
    assert meta["forward_mode"] == "decode" and meta["tokens"] == [1, 2] and meta["step"] == "inner"
    assert "step" not in ds.meta("target", 0, 2)
    assert list(ds.load("target", 0, 1)) == ["Linear", "Linear#1"]
    assert list(ds.load("target", 0, 2)) == ["outside"]


def test_manual_pass_block_and_end_pass_incomplete(tmp_path):
    """The public way to run a pass by hand: a with-block is one pass, and one an exception leaves
    is stored incomplete with it (as a root forward that raised); end_pass(incomplete=) says why."""
    lin = torch.nn.Linear(2, 2)
    x = torch.randn(1, 2)
    with fastdump.attach(lin, tmp_path, root_passes=False) as d, torch.inference_mode():
        with d.manual_pass(forward_mode="encode") as same:
            outs = [lin(x), lin(x + 1)]
        with pytest.raises(RuntimeError, match="boom"):
            with d.manual_pass(forward_mode="decode"):
                outs.append(lin(x + 2))
                raise RuntimeError("boom")
        d.begin_pass(step=2)
        outs.append(lin(x + 3))
        d.end_pass(incomplete="the verify step was cut short")
        with pytest.raises(ValueError, match="complete"):
            d.manual_pass(complete=True)
    assert same is d
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    dumped = [ds.load("target", 0, p) for p in (0, 1, 2)]
    assert list(dumped[0]) == ["Linear", "Linear#1"]
    assert same_bits(dumped[0]["Linear"], outs[0]) and same_bits(dumped[0]["Linear#1"], outs[1])
    assert same_bits(dumped[1]["Linear"], outs[2]) and same_bits(dumped[2]["Linear"], outs[3])
    metas = [ds.meta("target", 0, p) for p in (0, 1, 2)]
    assert metas[0]["complete"] and metas[0]["forward_mode"] == "encode"
    assert not metas[1]["complete"] and metas[1]["incomplete"] == "a forward raised RuntimeError: boom"
    assert not metas[2]["complete"] and metas[2]["incomplete"] == "the verify step was cut short"
    assert metas[2]["step"] == 2


def test_unwritable_root_keeps_the_model_serving(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    lin = torch.nn.Linear(2, 2)
    d = fastdump.attach(lin, blocker / "dump")
    y = lin(torch.ones(1, 2))
    assert y.shape == (1, 2)
    stats = d.close()
    assert stats["status"] == "error" and "cannot start dumping" in stats["error"]
    assert "cannot start dumping" in caplog.text


def test_bad_options_fail_before_the_model_runs(tmp_path):
    lin = torch.nn.Linear(2, 2)
    for bad in (dict(policy="sometimes"), dict(writer="fork"), dict(every=0), dict(role="a/b"),
                dict(pass_range=(5, 1)), dict(pass_range=(3, 3))):  # (3, 3): no pass, as FASTDUMP_PASSES=3:3
        with pytest.raises(ValueError):
            fastdump.attach(lin, tmp_path, **bad)
    assert "forward" not in lin.__dict__  # nothing was installed


def test_close_detaches(tmp_path):
    lin = torch.nn.Linear(2, 2)
    d = fastdump.attach(lin, tmp_path)
    assert "forward" in lin.__dict__
    d.close()
    assert "forward" not in lin.__dict__
    lin(torch.ones(1, 2))
    assert fastdump.open(tmp_path).passes("target", 0) == []


def ring_mappings() -> list:
    with open("/proc/self/maps") as maps:
        return [line.split()[-2] for line in maps if "/fastdump-" in line]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_close_unmaps_the_ring_without_waiting_for_the_garbage_collector(tmp_path):
    # A Dumper sits in reference cycles (wrappers, capture state): a closed one kept its 256 MiB
    # ring mapped and resident until a collection, so each attach/close cycle grew the process.
    model = TinyLM(layers=1)
    gc.collect()
    gc.disable()
    try:
        before = ring_mappings()
        for cycle in range(3):
            d = fastdump.attach(model, tmp_path / str(cycle), ring_mb=8)
            with torch.inference_mode():
                model(torch.tensor([[1, 2]]), model.new_cache())
            assert len(ring_mappings()) == len(before) + 1
            stats = d.close()
            assert ring_mappings() == before, cycle
            assert stats["status"] == "closed" and stats["passes"] == 1 and stats["tensors"] > 0
            assert d.stats()["tensors"] == stats["tensors"]  # stats after close: the same totals
    finally:
        gc.enable()
    for cycle in range(3):
        assert fastdump.open(tmp_path / str(cycle)).passes("target", 0) == [0]


def test_thread_writer(tmp_path):
    target = TinyLM(layers=1)
    ref = LeafReference(target)
    with fastdump.attach(target, tmp_path, writer="thread"), torch.inference_mode():
        ref(torch.tensor([[5, 6]]), target.new_cache())
    ref.remove()
    assert_pass_equal(fastdump.open(tmp_path).load("target", 0, 0), ref.passes[0], extra={"TinyLM"})


# --- Dumper.watch: any module, with convert= / before= hooks --------------------------------------


class Scored:
    """An output object fastdump cannot read by itself (not a tensor, container or dataclass)."""

    def __init__(self, hidden, scores):
        self.hidden, self.scores = hidden, scores


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, step):
        h = self.proj(x)
        x.mul_(2)  # in place on its input: `before` must see the value it was called with
        return Scored(h, h.sum(-1))


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.block = Block()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        first = self.block(x, step=0)
        second = self.block.forward(first.hidden, step=1)  # .forward() directly: watched too
        return self.head(second.hidden)


def _watch_twice(d, model, seen):
    def before(args, kwargs):
        seen.append(kwargs["step"])
        d.set_pass_meta(last_step=kwargs["step"])
        return {"x": args[0], "step": torch.tensor(kwargs["step"])}

    d.watch(model.block, "block", convert=lambda out: (out.hidden, {"scores": out.scores}), before=before)


def test_watch_a_module_called_twice_with_hooks(tmp_path):
    model, xs = Twice(), [torch.randn(3, 4) for _ in range(2)]
    with torch.no_grad():
        want = []
        for x in xs:  # reference: the same forward by hand, values cloned as they are made
            x = x.clone()
            x0 = x.clone()
            h1 = model.block.proj(x)
            x.mul_(2)
            h1c = h1.clone()
            h2 = model.block.proj(h1)
            h1.mul_(2)
            want.append({"block.proj": h1c, "block.x": x0, "block.step": torch.tensor(0), "block.0": h1c,
                         "block.1.scores": h1c.sum(-1), "block#1.x": h1c, "block#1.step": torch.tensor(1),
                         "block.proj#1": h2, "block#1.0": h2, "block#1.1.scores": h2.sum(-1),
                         "head": model.head(h2)})
    seen = []
    d = fastdump.attach(model, tmp_path, writer="thread", exclude="^(block|Twice)$")
    _watch_twice(d, model, seen)
    with torch.no_grad():
        outs = [model(x.clone()) for x in xs]
    stats = d.close()
    assert "forward" not in model.block.__dict__  # unwrapped
    assert stats["status"] == "closed" and stats["skipped"] == 0 and seen == [0, 1, 0, 1]
    ds = fastdump.open(tmp_path)
    for p, (out, expected) in enumerate(zip(outs, want)):
        got = ds.load("target", 0, p)
        # the capture order everywhere: inputs/before values, then the leaves inside, then the output
        assert list(got) == ["block.x", "block.step", "block.proj", "block.0", "block.1.scores",
                             "block#1.x", "block#1.step", "block.proj#1", "block#1.0", "block#1.1.scores", "head"]
        for name, value in expected.items():
            assert same_bits(got[name], value), name
        assert same_bits(got["head"], out)
        assert ds.meta("target", 0, p)["last_step"] == 1


def test_watch_hooks_run_only_in_selected_passes(tmp_path):
    model, seen = Twice(), []
    d = fastdump.attach(model, tmp_path, writer="thread", exclude="^block$", every=2)
    _watch_twice(d, model, seen)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(1, 4))
    d.close()
    assert seen == [0, 1, 0, 1]  # passes 0 and 2
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 2] and "block#1.0" in ds.load("target", 0, 2)


@pytest.mark.parametrize("fault", ["convert raises", "before raises", "before returns a list"])
def test_watch_hooks_that_fail_are_recorded_never_raised(tmp_path, fault):
    model = Twice()
    x = torch.randn(2, 4)
    with torch.no_grad():
        plain = model(x.clone())

    def convert(out):
        if fault == "convert raises":
            raise KeyError("no such field")
        return out.hidden

    def before(args, kwargs):
        if fault == "before raises":
            raise RuntimeError("bad batch")
        return [args[0]] if fault == "before returns a list" else None

    d = fastdump.attach(model, tmp_path, writer="thread", exclude="^block$")
    d.watch(model.block, "block", convert=convert, before=before)
    with torch.no_grad():
        out = model(x.clone())
    stats = d.close()
    assert same_bits(out, plain)  # served as without fastdump
    assert stats["status"] == "closed" and stats["skipped"] == 2  # both calls of block
    meta = fastdump.open(tmp_path).meta("target", 0, 0)
    got = fastdump.open(tmp_path).load("target", 0, 0)
    reasons = {s["name"]: s["reason"] for s in meta["skipped"]}
    assert set(reasons) == {"block", "block#1"} and meta["complete"] is True
    expected = {"convert raises": "convert(output) raised KeyError: 'no such field'",
                "before raises": "before(args, kwargs) raised RuntimeError: bad batch",
                "before returns a list": "before(args, kwargs) returned list, not a dict or None"}[fault]
    assert reasons["block"] == expected
    # what did not fail is there
    assert {"block.proj", "block.proj#1", "head", "Twice"} <= set(got)
    assert ("block#1" in got) == (fault != "convert raises")
    from fastdump import cli

    assert cli.main(["verify", str(tmp_path)]) == 0  # a recorded skip is not lost data


def test_a_hook_failing_with_a_new_message_each_pass_is_said_once_and_rank_json_stays_small(tmp_path, caplog):
    """A convert() whose exception text changes every pass (a request id in it): each distinct
    text was a new "said once" key (a set growing by one entry and one warning per pass, for as
    long as the server runs) and a new key of rank.json's skipped_reasons (O(passes) bytes,
    rewritten 4 times a second). Each pass still records its own text."""
    import json
    import logging

    model, served = Twice(), [0]

    def convert(out):
        raise KeyError(f"request {served[0]} not found")

    d = fastdump.attach(model, tmp_path, writer="thread", exclude="^block$")
    d.watch(model.block, "block", convert=convert)
    with caplog.at_level(logging.WARNING, logger="fastdump"), torch.no_grad():
        for served[0] in range(150):
            model(torch.randn(1, 4))
    stats = d.close()
    assert stats["status"] == "closed" and stats["skipped"] == 300  # (two calls of block a pass)
    said = [r for r in caplog.records if "convert(output) raised KeyError" in r.getMessage()]
    assert len(said) == 1, len(said)
    info = json.loads((d.dir / "rank.json").read_text())
    assert info["skipped"] == 300 and sum(info["skipped_reasons"].values()) == 300
    assert len(info["skipped_reasons"]) <= 65, len(info["skipped_reasons"])
    ds = fastdump.open(tmp_path)
    assert ds.meta("target", 0, 149)["skipped"][0]["reason"] == "convert(output) raised KeyError: 'request 149 not found'"


def test_watch_refuses_misuse_and_unwraps(tmp_path):
    model = Twice()
    own = model.head.forward  # an instance forward set before attach is put back at close
    model.head.forward = own
    d = fastdump.attach(model, tmp_path, writer="thread")
    with pytest.raises(ValueError, match="wraps that module already"):
        d.watch(model.block.proj, "proj")  # a selected leaf
    with pytest.raises(ValueError, match="wraps that module already"):
        d.watch(model, "root")  # the root: its wrapper delimits passes
    d.watch(model.block, "block")
    with pytest.raises(ValueError, match="wraps that module already"):
        d.watch(model.block, "block2")
    with pytest.raises(ValueError, match="non-empty"):
        d.watch(model.head, "")
    with pytest.raises(TypeError, match="convert must be callable"):
        d.watch(model.head, "h", convert="hidden")
    with pytest.raises(TypeError, match="no forward"):
        d.watch(object(), "thing")
    d.close()
    assert "forward" not in model.block.__dict__ and "forward" not in model.block.proj.__dict__
    assert model.head.__dict__["forward"] is own
    with pytest.raises(RuntimeError, match="closed"):
        d.watch(model.block, "block")


def test_watch_under_torch_compile_dumps_the_real_values(tmp_path):
    torch._dynamo.reset()
    model, seen = Twice(), []
    xs = [torch.randn(3, 4) for _ in range(2)]
    d = fastdump.attach(model, tmp_path, writer="thread", exclude="^block$")
    _watch_twice(d, model, seen)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        outs = [compiled(x.clone()) for x in xs]
    stats = d.close()
    torch._dynamo.reset()
    assert stats["status"] == "closed" and stats["skipped"] == 0 and seen == [0, 1, 0, 1]
    ds = fastdump.open(tmp_path)
    for p, (x, out) in enumerate(zip(xs, outs)):
        got = ds.load("target", 0, p)
        assert same_bits(got["block.x"], x) and same_bits(got["head"], out) and same_bits(got["Twice"], out)
        assert same_bits(got["block.0"], got["block.proj"]) and same_bits(got["block#1.0"], got["block.proj#1"])
        assert same_bits(got["block.1.scores"], got["block.proj"].sum(-1))
        assert same_bits(got["block#1.x"], got["block.proj"])  # before the second call doubled it


def test_watch_on_a_dumper_without_model(tmp_path):
    """attach(None) + watch: a module of one's choosing, dumped in manual passes only."""
    block = Block()
    x = torch.randn(2, 4)
    with torch.no_grad():
        block(x.clone(), step=0)  # before attach: nothing to do with fastdump
        d = fastdump.attach(None, tmp_path, writer="thread")
        d.watch(block, "blk", convert=lambda out: out.scores)
        block(x.clone(), step=0)  # outside a pass: passes through, no pass of its own
        d.begin_pass()
        out = block(x.clone(), step=0)
        d.end_pass()
    d.close()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0]
    got = ds.load("target", 0, 0)
    assert list(got) == ["blk"] and same_bits(got["blk"], out.scores)


class _Eagle3Target(torch.nn.Module):
    """Runs ``run_draft(ids, hidden)`` inside its own forward (EAGLE-3: the draft takes the target's
    hidden state), or leaves it to a forward hook on ``layer``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.embed = torch.nn.Embedding(50, 8)
        self.layer = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 50, bias=False)
        self.run_draft = None

    def forward(self, ids):
        h = self.layer(self.embed(ids))
        logits = self.lm_head(h)
        if self.run_draft is not None:
            self.run_draft(ids, h)
        return logits


class _Eagle3Draft(torch.nn.Module):
    def __init__(self, target):
        super().__init__()
        self.embed, self.lm_head = target.embed, target.lm_head  # shared, as EAGLE's are
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, ids, aux):
        h = self.fc(torch.cat([self.embed(ids), aux], -1))
        return self.lm_head(h), h


@pytest.mark.parametrize("native_pass", [True, False])
@pytest.mark.parametrize("where", ["forward", "hook"])
@pytest.mark.parametrize("draft_every", [1, 2])
def test_a_draft_run_inside_the_target_forward_is_its_own_pass_alone(tmp_path, monkeypatch, native_pass, where,
                                                                      draft_every):
    """EAGLE-3 style: the draft runs inside the target's forward (the forward itself, or a hook on one
    of its modules), two draft steps per target step, on the modules both share. Each role's pass
    holds what its own forward computed, nothing of the other's (the target's pass used to get the
    draft's embedding and LM head calls as `embed#1`, `lm_head#1`..., and verify said OK); so also
    when the draft's passes are left out by its selection."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native_pass)
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    drafted = []  # (ids, aux, draft logits, draft hidden, the target's pass) per draft step

    def run_draft(ids, hidden):
        for step in range(2):
            ids = ids + step + 1
            logits, h = draft(ids, hidden)
            drafted.append((ids, hidden, logits, h, dt.pass_id))

    hook = None
    if where == "forward":
        target.run_draft = run_draft
    else:
        hook = target.layer.register_forward_hook(lambda m, args, out: run_draft(args[0].argmax(-1) % 50, out))
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", every=draft_every)
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[4]]), torch.tensor([[5]])]
    with torch.inference_mode():
        logits = [target(ids) for ids in prompts]
    assert dt.close()["status"] == "closed" and dd.close()["status"] == "closed"
    target.run_draft = None
    if hook is not None:
        hook.remove()

    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    with torch.inference_mode():  # (the references: the same modules on the same inputs, after close)
        _check_eagle3_passes(ds, target, prompts, logits, drafted, draft_every)
    assert not cli_dump.verify_dump(str(tmp_path)).problems


def _check_eagle3_passes(ds, target, prompts, logits, drafted, draft_every):
    for pass_id, ids in enumerate(prompts):
        e = target.embed(ids)
        h = target.layer(e)
        want = {"embed": e, "layer": h, "lm_head": logits[pass_id], "_Eagle3Target": logits[pass_id]}
        dumped = ds.load("target", 0, pass_id)
        assert sorted(dumped) == sorted(want)
        assert all(same_bits(dumped[n], want[n]) for n in want)
        meta = ds.meta("target", 0, pass_id)
        assert meta["complete"]
        # and what ran inside it: every draft pass, the ones the draft's selection left out too
        assert meta["suspended_for"] == [{"role": "draft", "pass": p} for p, d in enumerate(drafted) if d[4] == pass_id]
    kept = list(range(0, len(drafted), draft_every))
    assert ds.passes("draft", 0) == kept
    for pass_id in kept:
        ids, aux, dl, dh, target_pass = drafted[pass_id]
        # where it ran: a reader can put the two roles' passes in order
        assert ds.meta("draft", 0, pass_id)["nested_in"] == [{"role": "target", "pass": target_pass}]
        want = {"embed": target.embed(ids), "fc": dh, "lm_head": dl, "_Eagle3Draft.0": dl, "_Eagle3Draft.1": dh}
        dumped = ds.load("draft", 0, pass_id)
        assert sorted(dumped) == sorted(want)
        assert all(same_bits(dumped[n], want[n]) for n in want)


@pytest.mark.parametrize("native_pass", [True, False])
def test_two_dumpers_on_one_model_with_different_selections_both_dump_every_forward(tmp_path, monkeypatch,
                                                                                      native_pass):
    """Their root wrappers nest at every forward (the later one's around the earlier's): neither pass
    is suspended for the other's, as a draft's pass nested in the target's forward suspends that."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native_pass)
    target = _Eagle3Target()
    wide = fastdump.attach(target, tmp_path, role="wide")
    narrow = fastdump.attach(target, tmp_path, role="narrow", include=r"^embed$", inputs=True)
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[4]])]
    with torch.inference_mode():
        logits = [target(ids) for ids in prompts]
    assert narrow.close()["status"] == "closed" and wide.close()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    for pass_id, ids in enumerate(prompts):
        with torch.inference_mode():
            e = target.embed(ids)
            h = target.layer(e)
        want = {"embed": e, "layer": h, "lm_head": logits[pass_id], "_Eagle3Target": logits[pass_id]}
        dumped = ds.load("wide", 0, pass_id)
        assert sorted(dumped) == sorted(want) and all(same_bits(dumped[n], want[n]) for n in want)
        dumped = ds.load("narrow", 0, pass_id)
        assert sorted(dumped) == ["embed", "embed.input.0"]
        assert same_bits(dumped["embed"], e) and same_bits(dumped["embed.input.0"], ids)
    assert not cli_dump.verify_dump(str(tmp_path)).problems


def test_a_draft_pass_begun_inside_the_target_forward_and_never_ended_is_closed_with_it(tmp_path):
    """The draft's begin_pass() inside the target's forward without its end_pass(): the target's
    pass cannot hold what ran after that (its own output went to no pass), so it is incomplete, and
    the draft's pass is closed with it, dangling, rather than left open for the target's next
    passes to suspend and take the draft's later calls."""
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False)
    drafted = []

    def run_draft(ids, hidden):
        target.run_draft = None  # the first forward only
        dd.begin_pass(forward_mode="draft")  # never ended
        drafted.append((ids + 1, draft(ids + 1, hidden)))

    target.run_draft = run_draft
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[4]])]
    with torch.inference_mode():
        logits = [target(ids) for ids in prompts]
    assert dt.close()["status"] == "closed" and dd.close()["status"] == "closed"

    ds = fastdump.open(tmp_path)
    with torch.inference_mode():
        e = [target.embed(ids) for ids in prompts]
        h = [target.layer(x) for x in e]
    first, second = ds.load("target", 0, 0), ds.load("target", 0, 1)
    assert sorted(first) == ["embed", "layer", "lm_head"]  # its own calls, none of the draft's
    assert same_bits(first["embed"], e[0]) and same_bits(first["layer"], h[0])
    assert same_bits(first["lm_head"], logits[0])
    meta = ds.meta("target", 0, 0)
    assert not meta["complete"] and meta["incomplete"].startswith("a pass of another Dumper opened inside")
    assert sorted(second) == ["_Eagle3Target", "embed", "layer", "lm_head"] and ds.meta("target", 0, 1)["complete"]
    assert "nested_in" not in ds.meta("target", 0, 1)
    assert same_bits(second["_Eagle3Target"], logits[1]) and same_bits(second["layer"], h[1])
    assert ds.passes("draft", 0) == [0]
    ids, (dl, dh) = drafted[0]
    dumped = ds.load("draft", 0, 0)
    assert sorted(dumped) == ["_Eagle3Draft.0", "_Eagle3Draft.1", "embed", "fc", "lm_head"]
    assert same_bits(dumped["lm_head"], dl) and same_bits(dumped["fc"], dh)
    meta = ds.meta("draft", 0, 0)
    assert not meta["complete"] and "opened inside ended" in meta["incomplete"]


@pytest.mark.parametrize("native_pass", [True, False])
@pytest.mark.parametrize("draft_root_selected", [True, False])
def test_a_draft_forward_outside_any_pass_of_its_own_stays_out_of_the_target_pass(tmp_path, monkeypatch, capsys,
                                                                                  native_pass, draft_root_selected):
    """The draft attached with root_passes=False runs inside the target's forward without a pass of
    its own (no begin_pass): its calls of the embedding and LM head both share went into the
    target's pass as `embed#1`, `lm_head#1`, which read as the target calling them twice, and verify
    said OK. The target's pass is suspended while the draft's forward runs, and says so
    (suspended_for, pass None: the draft's calls went to no pass); the target's own repeated calls,
    before and after the draft's, are still `name#k`."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native_pass)
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False,
                         exclude=None if draft_root_selected else r"^_Eagle3Draft$")
    extra = []  # the target's own second calls: (embed(ids + 3), lm_head(h)) per pass

    def run_draft(ids, hidden):
        e = target.embed(ids + 3)  # the target's own code: a legitimate repeated call
        for step in range(2):  # draft steps, one through module.forward as engines call it
            (draft if step == 0 else draft.forward)(ids + step + 1, hidden)
        extra.append((e, target.lm_head(hidden)))

    target.run_draft = run_draft
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[4]])]
    with torch.inference_mode():
        logits = [target(ids) for ids in prompts]
        target.run_draft = None
        after = target(torch.tensor([[6]]))  # no draft: nothing suspended
    assert dt.close()["status"] == "closed" and dd.close()["status"] == "closed"

    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2] and ds.ranks("draft") and ds.passes("draft", 0) == []
    with torch.inference_mode():
        for pass_id, ids in enumerate(prompts):
            e = target.embed(ids)
            h = target.layer(e)
            want = {"embed": e, "layer": h, "lm_head": logits[pass_id], "_Eagle3Target": logits[pass_id],
                    "embed#1": extra[pass_id][0], "lm_head#1": extra[pass_id][1]}
            dumped = ds.load("target", 0, pass_id)
            assert sorted(dumped) == sorted(want)
            assert all(same_bits(dumped[n], want[n]) for n in want)
            meta = ds.meta("target", 0, pass_id)
            assert meta["complete"] and meta["suspended_for"] == [{"role": "draft", "pass": None}] * 2
    assert sorted(ds.load("target", 0, 2)) == ["_Eagle3Target", "embed", "layer", "lm_head"]
    assert same_bits(ds.load("target", 0, 2)["lm_head"], after)
    assert "suspended_for" not in ds.meta("target", 0, 2)
    assert not cli_dump.verify_dump(str(tmp_path)).problems
    capsys.readouterr()
    assert cli_dump.main(["ls", str(tmp_path)]) == 0
    assert "[2 pass(es) suspended for another role's: meta suspended_for]" in capsys.readouterr().out
    assert cli_dump.main(["show", str(tmp_path), "--role", "target", "--pass", "0"]) == 0
    assert '"suspended_for": [{"role": "draft", "pass": null}, {"role": "draft", "pass": null}]' \
        in capsys.readouterr().out


def test_a_draft_pass_begun_inside_its_own_forward_outside_passes_nests_in_the_target_pass(tmp_path):
    """root_passes=False, the draft's pass begun and ended inside its forward (hooks on its `fc`),
    the forward run inside the target's: the pass records where it ran (nested_in), the target's
    pass records both the forward and the pass (suspended_for), and the draft's LM head call after
    its pass ended, still inside its forward, goes to neither pass."""
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False)
    draft.fc.register_forward_pre_hook(lambda m, args: dd.begin_pass(step="fc"))
    draft.fc.register_forward_hook(lambda m, args, out: dd.end_pass() and None)
    drafted = []
    target.run_draft = lambda ids, hidden: drafted.append(draft(ids + 1, hidden))
    with torch.inference_mode():
        logits = target(torch.tensor([[1, 2, 3]]))
    assert dt.close()["status"] == "closed" and dd.close()["status"] == "closed"

    ds = fastdump.open(tmp_path)
    assert sorted(ds.load("target", 0, 0)) == ["_Eagle3Target", "embed", "layer", "lm_head"]
    assert same_bits(ds.load("target", 0, 0)["lm_head"], logits)
    assert ds.meta("target", 0, 0)["suspended_for"] == [{"role": "draft", "pass": None}, {"role": "draft", "pass": 0}]
    assert ds.passes("draft", 0) == [0]
    assert sorted(ds.load("draft", 0, 0)) == ["fc"] and same_bits(ds.load("draft", 0, 0)["fc"], drafted[0][1])
    meta = ds.meta("draft", 0, 0)
    assert meta["complete"] and meta["step"] == "fc" and meta["nested_in"] == [{"role": "target", "pass": 0}]
    assert not cli_dump.verify_dump(str(tmp_path)).problems


@pytest.mark.parametrize("closer", ["forward", "thread"])
def test_the_draft_dumper_closed_inside_its_nested_pass_keeps_the_rest_of_its_forward_out_of_the_target_pass(
        tmp_path, closer):
    """The draft's Dumper closed in the middle of its pass nested in the target's forward (by a hook
    in the draft's forward, or by another thread meanwhile): the target's pass captured again at
    once, and took the draft's later LM head call as its own `lm_head#1`, complete, verify OK. It
    stays suspended until the draft's forward returns; the target's own later calls are its own."""
    import threading
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft")
    closed = []

    def close_draft(module, args, out):
        if closer == "forward":
            closed.append(dd.close())
        else:
            t = threading.Thread(target=lambda: closed.append(dd.close()))
            t.start()
            t.join()

    draft.fc.register_forward_hook(close_draft)
    own = []  # the target's own LM head call after the draft's forward

    def run_draft(ids, hidden):
        draft(ids + 1, hidden)
        own.append(target.lm_head(hidden + 1))

    target.run_draft = run_draft
    with torch.inference_mode():
        logits = target(torch.tensor([[1, 2, 3]]))
        target.run_draft = None
        second = target(torch.tensor([[4]]))
    assert [s["status"] for s in closed] == ["closed"] and dt.close()["status"] == "closed"

    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    assert sorted(dumped) == ["_Eagle3Target", "embed", "layer", "lm_head", "lm_head#1"]
    assert same_bits(dumped["lm_head"], logits) and same_bits(dumped["lm_head#1"], own[0])
    meta = ds.meta("target", 0, 0)
    assert meta["complete"] and meta["suspended_for"] == [{"role": "draft", "pass": 0}]
    assert sorted(ds.load("target", 0, 1)) == ["_Eagle3Target", "embed", "layer", "lm_head"]
    assert same_bits(ds.load("target", 0, 1)["lm_head"], second) and ds.meta("target", 0, 1)["complete"]
    assert sorted(ds.load("draft", 0, 0)) == ["embed", "fc"]
    assert ds.meta("draft", 0, 0)["incomplete"].startswith("still open at close()")
    assert not cli_dump.verify_dump(str(tmp_path)).problems


def test_the_draft_dumper_closed_inside_its_nested_manual_pass_marks_the_target_pass_mixed(tmp_path):
    """As above with the draft's pass begun by hand (begin_pass() in the target's forward): where
    that pass's forward ends is not known, so the target's pass captures again at the close, takes
    the draft's LM head call as `lm_head#1`, and is marked mixed: verify fails."""
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False)
    draft.fc.register_forward_hook(lambda m, args, out: dd.close() and None)

    def run_draft(ids, hidden):
        dd.begin_pass()
        draft(ids + 1, hidden)

    target.run_draft = run_draft
    with torch.inference_mode():
        target(torch.tensor([[1, 2, 3]]))
    assert dt.close()["mixed_passes"] == 1

    ds = fastdump.open(tmp_path)
    assert sorted(ds.load("target", 0, 0)) == ["_Eagle3Target", "embed", "layer", "lm_head", "lm_head#1"]
    meta = ds.meta("target", 0, 0)
    reason = ("a pass of role 'draft' nested in it was ended by close() before its end_pass(): what ran after "
              "(that role's calls of the modules both wrap too) went into this pass (mixed tensors)")
    assert meta["mixed"] is True and meta["incomplete"] == reason
    problems = cli_dump.verify_dump(str(tmp_path)).problems
    assert len(problems) == 1 and problems[0].endswith(f"pass 0 mixes tensors of several forwards: {reason}")


@pytest.mark.parametrize("root_passes", [True, False])
@pytest.mark.parametrize("caught", [True, False])
def test_a_draft_forward_raising_inside_the_target_forward_gives_the_target_pass_back(tmp_path, root_passes, caught):
    """The draft's forward raises inside the target's (after its embedding and fc ran): the target's
    pass captures again from there on, with its own later calls only; caught by the target, its
    pass stays complete; raised through it, it is incomplete with the reason. The next target pass
    is whole and suspended for nothing."""
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=root_passes)

    def boom(module, args, out):
        raise RuntimeError("boom")

    hook = draft.fc.register_forward_hook(boom)
    own = []

    def run_draft(ids, hidden):
        try:
            draft(ids + 1, hidden)
        except RuntimeError:
            if not caught:
                raise
        own.append(target.lm_head(hidden + 1))

    target.run_draft = run_draft
    with torch.inference_mode():
        if caught:
            target(torch.tensor([[1, 2, 3]]))
        else:
            with pytest.raises(RuntimeError, match="boom"):
                target(torch.tensor([[1, 2, 3]]))
        target.run_draft = None
        hook.remove()
        second = target(torch.tensor([[4]]))
    assert dd.close()["status"] == "closed" and dt.close()["status"] == "closed"

    ds = fastdump.open(tmp_path)
    first, meta = ds.load("target", 0, 0), ds.meta("target", 0, 0)
    draft_pass = 0 if root_passes else None
    assert meta["suspended_for"] == [{"role": "draft", "pass": draft_pass}]
    if caught:
        assert sorted(first) == ["_Eagle3Target", "embed", "layer", "lm_head", "lm_head#1"] and meta["complete"]
        assert same_bits(first["lm_head#1"], own[0])
    else:
        assert sorted(first) == ["embed", "layer", "lm_head"]
        assert not meta["complete"] and meta["incomplete"] == "a forward raised RuntimeError: boom"
    assert sorted(ds.load("target", 0, 1)) == ["_Eagle3Target", "embed", "layer", "lm_head"]
    assert same_bits(ds.load("target", 0, 1)["lm_head"], second) and "suspended_for" not in ds.meta("target", 0, 1)
    if root_passes:
        assert sorted(ds.load("draft", 0, 0)) == ["embed", "fc"]
        assert ds.meta("draft", 0, 0)["incomplete"] == "a forward raised RuntimeError: boom"
    else:
        assert ds.passes("draft", 0) == []
    assert not cli_dump.verify_dump(str(tmp_path)).problems


@pytest.mark.parametrize("key", ["nested_in", "suspended_for", "suspended_for_left_out"])
def test_the_nesting_meta_keys_are_fastdumps_own(tmp_path, key):
    """A user's key of that name would read as a nesting of two roles' passes that never happened."""
    lin = torch.nn.Linear(2, 2)
    with fastdump.attach(lin, tmp_path, root_passes=False) as d:
        for call in (d.set_pass_meta, d.begin_pass, d.manual_pass):
            with pytest.raises(ValueError, match=f"'{key}': a key fastdump's readers add"):
                call(**{key: []})
    assert not d.in_pass


def test_a_pass_suspended_for_many_draft_passes_keeps_the_first_256_and_counts_the_rest(tmp_path):
    """A manual target pass around 300 draft steps: suspended_for stays small (its pass's meta
    travels through the ring with the pass's end) and says how many it left out."""
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target", root_passes=False)
    dd = fastdump.attach(draft, tmp_path, role="draft", every=1000)  # (its pass 0 alone is dumped)
    ids = torch.tensor([[1, 2]])
    with torch.inference_mode(), dt.manual_pass():
        hidden = target.layer(target.embed(ids))
        for _ in range(300):
            draft(ids, hidden)
    assert dd.close()["passes"] == 1 and dt.close()["status"] == "closed"
    meta = fastdump.open(tmp_path).meta("target", 0, 0)
    assert meta["suspended_for"] == [{"role": "draft", "pass": p} for p in range(256)]
    assert meta["suspended_for_left_out"] == 44 and meta["complete"]


def test_an_idle_dumper_on_a_submodule_leaves_the_whole_model_pass_alone(tmp_path):
    """A Dumper attached with root_passes=False to a submodule, to dump it on demand, runs outside a
    pass of its own inside the pass of a Dumper on the whole model: its forward is that model's own
    computation, which that pass keeps (the rule that keeps an EAGLE draft's forward out of the
    target's pass is for models that are not part of it)."""
    target = _Eagle3Target()
    whole = fastdump.attach(target, tmp_path, role="whole")
    layer = fastdump.attach(target.layer, tmp_path, role="layer", root_passes=False, inputs=True)
    with torch.inference_mode():
        logits = [target(torch.tensor([[1, 2, 3]])), target(torch.tensor([[4]]))]
    assert layer.close()["passes"] == 0 and whole.close()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    for pass_id in (0, 1):
        dumped = ds.load("whole", 0, pass_id)
        assert sorted(dumped) == ["_Eagle3Target", "embed", "layer", "lm_head"]
        with torch.inference_mode():
            assert same_bits(dumped["layer"], target.layer(dumped["embed"]))
        assert same_bits(dumped["lm_head"], logits[pass_id])
        meta = ds.meta("whole", 0, pass_id)
        assert meta["complete"] and "suspended_for" not in meta


def test_a_target_pass_ended_inside_a_draft_forward_outside_passes_is_whole(tmp_path, caplog):
    """The target's manual pass ended (by a hook) while the draft's forward, outside any pass of its
    own, had it suspended: nothing of the target's pass went elsewhere, so it is complete, and no
    dangling draft pass is "closed" (there is none). It was marked incomplete, and a draft pass -1
    reported closed."""
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target", root_passes=False)
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False)
    draft.fc.register_forward_hook(lambda m, args, out: dt.end_pass() and None)
    ids = torch.tensor([[1, 2]])
    with torch.inference_mode():
        dt.begin_pass()
        e = target.embed(ids)
        h = target.layer(e)
        draft(ids, h)
        target.lm_head(h)  # after the target's pass ended: in no pass
        dt.begin_pass()
        logits = target(ids)
        dt.end_pass()
    assert dd.close()["passes"] == 0 and dt.close()["incomplete_passes"] == 0
    assert "dangling" not in caplog.text and "closed, marked incomplete" not in caplog.text
    ds = fastdump.open(tmp_path)
    first = ds.load("target", 0, 0)
    assert sorted(first) == ["embed", "layer"] and same_bits(first["embed"], e) and same_bits(first["layer"], h)
    meta = ds.meta("target", 0, 0)
    assert meta["complete"] and meta["suspended_for"] == [{"role": "draft", "pass": None}]
    second = ds.load("target", 0, 1)
    assert sorted(second) == ["_Eagle3Target", "embed", "layer", "lm_head"] and same_bits(second["lm_head"], logits)
    assert ds.meta("target", 0, 1)["complete"] and not cli_dump.verify_dump(str(tmp_path)).problems


def test_a_draft_pass_begun_after_the_target_pass_ended_inside_the_draft_forward_nests_in_nothing(tmp_path):
    """Inside the draft's forward (outside any pass of its own) the target's pass ends, then the
    draft's begins: it ran inside no target pass, so it has no nested_in (it named the ended one)."""
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target", root_passes=False)
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False)

    def switch(module, args, out):
        dt.end_pass()
        dd.begin_pass()

    draft.fc.register_forward_hook(switch)
    ids = torch.tensor([[1, 2]])
    with torch.inference_mode():
        dt.begin_pass()
        h = target.layer(target.embed(ids))
        draft_logits, _ = draft(ids, h)
        dd.end_pass()
    assert dd.close()["passes"] == 1 and dt.close()["passes"] == 1
    ds = fastdump.open(tmp_path)
    assert sorted(ds.load("draft", 0, 0)) == ["lm_head"] and same_bits(ds.load("draft", 0, 0)["lm_head"], draft_logits)
    assert "nested_in" not in ds.meta("draft", 0, 0)
    assert ds.meta("target", 0, 0)["suspended_for"] == [{"role": "draft", "pass": None}]
    assert sorted(ds.load("target", 0, 0)) == ["embed", "layer"]


class _LazyDraft(_Eagle3Draft):
    """A draft whose forward returns its work undone: a generator of two steps, a coroutine, or an
    async generator of two steps; its modules run when the caller consumes it."""

    kind = "generator"

    def forward(self, ids, aux):
        def step(s):
            return self.lm_head(self.fc(torch.cat([self.embed(ids + s), aux], -1)))

        def steps():
            for s in range(2):
                yield step(s)

        async def coroutine():
            await asyncio.sleep(0)
            return [step(0), step(1)]

        async def async_steps():
            for s in range(2):
                await asyncio.sleep(0)
                yield step(s)

        return {"generator": steps, "coroutine": coroutine, "async generator": async_steps}[self.kind]()


def _consume(lazy, kind):
    if kind == "generator":
        return list(lazy)

    async def gather():
        return [x async for x in lazy]

    return asyncio.run(lazy if kind == "coroutine" else gather())


@pytest.mark.parametrize("root_passes", [False, True])
@pytest.mark.parametrize("kind", ["generator", "coroutine", "async generator"])
def test_a_draft_forward_returning_a_generator_keeps_its_work_out_of_the_target_pass(tmp_path, caplog, kind,
                                                                                     root_passes):
    """The draft's forward returns a generator (coroutine, async generator) that the target's forward
    consumes: its modules ran after the draft's wrapper had resumed the target's pass, so the draft's
    calls of the shared embedding and LM head went into the target's pass as `embed#1`, `lm_head#1`,
    complete, verify OK. Every step of the result now runs as the draft's forward does: outside a
    draft pass it suspends the target's pass; inside one (begin_pass() around its consumption) it is
    that pass's. With root_passes=True its pass ended before the work ran: said once."""
    import collections.abc
    target = _Eagle3Target()
    draft = _LazyDraft(target)
    draft.kind = kind
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=root_passes, exclude=r"^_LazyDraft$")
    drafted = []  # (ids, aux, [draft logits per step]) of the draft's manual pass

    def run_draft(ids, hidden):
        lazy = draft(ids + 1, hidden)
        assert isinstance(lazy, {"generator": collections.abc.Generator, "coroutine": collections.abc.Coroutine,
                                 "async generator": collections.abc.AsyncGenerator}[kind])
        _consume(lazy, kind)  # outside any draft pass
        lazy = draft(ids + 2, hidden)
        with dd.manual_pass(step="draft"):
            drafted.append((ids + 2, hidden, _consume(lazy, kind)))

    target.run_draft = run_draft
    with torch.inference_mode():
        logits = target(torch.tensor([[1, 2, 3]]))
    assert dd.close()["status"] == "closed" and dt.close()["status"] == "closed"

    ds = fastdump.open(tmp_path)
    with torch.inference_mode():
        e = target.embed(torch.tensor([[1, 2, 3]]))
        want = {"embed": e, "layer": target.layer(e), "lm_head": logits, "_Eagle3Target": logits}
    dumped = ds.load("target", 0, 0)
    assert sorted(dumped) == sorted(want) and all(same_bits(dumped[n], want[n]) for n in want)
    assert ds.meta("target", 0, 0)["complete"]
    manual = [p for p in ds.passes("draft", 0) if ds.meta("draft", 0, p).get("step") == "draft"]
    assert len(manual) == 1
    ids, aux, steps = drafted[0]
    with torch.inference_mode():
        dumped = ds.load("draft", 0, manual[0])
        want = {"embed": draft.embed(ids), "embed#1": draft.embed(ids + 1), "lm_head": steps[0],
                "lm_head#1": steps[1]}
        want["fc"] = draft.fc(torch.cat([want["embed"], aux], -1))
        want["fc#1"] = draft.fc(torch.cat([want["embed#1"], aux], -1))
    assert sorted(dumped) == sorted(want) and all(same_bits(dumped[n], want[n]) for n in want)
    assert ds.meta("draft", 0, manual[0])["nested_in"] == [{"role": "target", "pass": 0}]
    lazy_said = [r.getMessage() for r in caplog.records if "the root forward returned a" in r.getMessage()]
    if root_passes:
        name = {"async generator": "async_generator"}.get(kind, kind)
        assert len(lazy_said) == 1 and f"the root forward returned a {name}: its modules run when" in lazy_said[0]
    else:
        assert lazy_said == [] and ds.passes("draft", 0) == manual == [0]
    assert not cli_dump.verify_dump(str(tmp_path)).problems


class _CleanupDraft(_Eagle3Draft):
    """A draft whose forward returns a generator (or coroutine) of steps whose ``finally`` calls
    the LM head it shares with the target (a cleanup step)."""

    kind = "generator"

    def forward(self, ids, aux):
        def steps():
            try:
                for s in range(3):
                    yield self.fc(torch.cat([self.embed(ids + s), aux], -1))
            finally:
                self.cleanup.append(self.lm_head(aux))

        async def coroutine():
            try:
                for s in range(3):
                    self.fc(torch.cat([self.embed(ids + s), aux], -1))
                    await asyncio.sleep(0)
            finally:
                self.cleanup.append(self.lm_head(aux))

        return {"generator": steps, "coroutine": coroutine}[self.kind]()


@pytest.mark.parametrize("kind", ["generator", "coroutine"])
def test_a_lazy_draft_result_dropped_unconsumed_keeps_its_cleanup_out_of_the_target_pass(tmp_path, kind):
    """The draft's generator (coroutine) is stepped once, then dropped unconsumed inside the
    target's next pass: the garbage collector closed the real object, whose ``finally`` called the
    shared LM head with no suspension, so the target's pass got the draft's call as ``lm_head#1``,
    complete, verify OK. The stand-in closes it through the suspension: the target's passes hold
    their own calls, bit for bit, and the suspension is recorded."""
    target = _Eagle3Target()
    draft = _CleanupDraft(target)
    draft.kind, draft.cleanup = kind, []
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False, exclude=r"^_CleanupDraft$")
    held = []

    def run_draft(ids, hidden):
        lazy = draft(ids + 1, hidden)
        lazy.send(None)  # one step, outside any draft pass
        held.append(lazy)

    ids = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])]
    with torch.inference_mode():
        target.run_draft = run_draft
        logits = [target(ids[0])]
        target.run_draft = lambda ids, h: held.clear()  # dropped unconsumed inside the next target pass
        logits.append(target(ids[1]))
    assert len(draft.cleanup) == 1  # (it ran, in the target's second pass)
    assert dd.close()["status"] == "closed" and dt.close()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    for p in range(2):
        with torch.inference_mode():
            e = target.embed(ids[p])
            want = {"embed": e, "layer": target.layer(e), "lm_head": logits[p], "_Eagle3Target": logits[p]}
        dumped = ds.load("target", 0, p)
        assert sorted(dumped) == sorted(want) and all(same_bits(dumped[n], want[n]) for n in want), p
    assert ds.meta("target", 0, 1)["suspended_for"] == [{"role": "draft", "pass": None}]
    assert ds.passes("draft", 0) == []
    assert not cli_dump.verify_dump(str(tmp_path)).problems


def test_the_root_manifest_is_the_first_dumpers_and_is_never_overwritten(tmp_path):
    """fastdump.json records the run (config, command): a second Dumper on the root (the draft
    role, another rank) leaves the first's record as it was."""
    from fastdump.capture.manifest import write_manifest

    assert write_manifest(tmp_path, {"policy": "block", "segment_passes": 2}, "target", "TP0_PP0_Rank0_pid1") is True
    first = (tmp_path / "fastdump.json").read_bytes()
    assert write_manifest(tmp_path, {"policy": "drop"}, "draft", "TP0_PP0_Rank0_pid2") is False
    assert (tmp_path / "fastdump.json").read_bytes() == first
    manifest = json.loads(first)
    assert manifest["format"] == "fastdump" and manifest["config"] == {"policy": "block", "segment_passes": 2}
    assert manifest["session"] == {"role": "target", "rank_dir": "TP0_PP0_Rank0_pid1"}  # (whose config it is)


def test_the_root_manifest_is_durable_before_it_is_visible(tmp_path, monkeypatch):
    """fastdump.json is written once and never again: its temporary file is fsynced before it is
    linked into place and the root after it, or a power cut leaves an empty manifest that no later
    Dumper rewrites (it exists)."""
    from fastdump.capture.manifest import write_manifest

    events = []
    real_fsync, real_link = os.fsync, os.link
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "link", lambda src, dst: (events.append(("link", str(src), str(dst))),
                                                      real_link(src, dst))[1])
    write_manifest(tmp_path, {"policy": "block"}, "target", "TP0_PP0_Rank0_pid1")
    monkeypatch.undo()
    (linked,) = [k for k, e in enumerate(events) if e[0] == "link"]
    temp, target = events[linked][1:]
    assert target == str(tmp_path / "fastdump.json")
    assert events[:linked] == [("sync", temp)] and events[linked + 1:] == [("sync", str(tmp_path))]
    assert not os.path.exists(temp) and os.listdir(tmp_path) == ["fastdump.json"]


def test_attaching_one_model_twice_says_so_and_what_to_do(tmp_path, caplog):
    """A second attach of the same model without close() said "another Dumper ... already dumps
    role 'target' ... (give each model its own role=)": there is one model, and under two roles
    each Dumper dumps every call of it. Now it names the model's first Dumper and says to close it."""
    import logging

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="fastdump"):
        first = fastdump.attach(model, tmp_path, writer="thread")
        second = fastdump.attach(model, tmp_path, role="again", writer="thread")
        third = fastdump.attach(other, tmp_path, writer="thread")  # another model, same role: the old advice
    try:
        warnings = [r.getMessage() for r in caplog.records if "already" in r.getMessage()]
        assert warnings == [
            f"fastdump: this model is already attached (role 'target', {first.dir}); both Dumpers dump every "
            "call of it. close() that Dumper before attaching again",
            f"fastdump: another Dumper of this process already dumps role 'target', ranks "
            f"{os.path.basename(third.dir).rsplit('_', 1)[0]} to {first.dir}; this one writes its own directory "
            f"{third.dir} (give each model its own role=)",
        ]
    finally:
        for dumper in (first, second, third):
            dumper.close()


@pytest.mark.parametrize("kind", ["generator", "coroutine"])
def test_a_lazy_result_dropped_unconsumed_inside_its_own_dumpers_pass_is_closed_after_that_pass(tmp_path, kind):
    """The draft (manual passes) steps its generator (coroutine) in pass 0 and drops it unconsumed in
    pass 1: its ``finally`` called the shared LM head right there, inside pass 1, which then held an
    ``lm_head`` the pass never called, complete, verify OK (the forward called inside a pass returned
    the real object, which the collector closed where it was). Now it is closed once pass 1 has
    ended, outside any pass: pass 1 holds its own call alone, the cleanup still runs."""
    target = _Eagle3Target()
    draft = _CleanupDraft(target)
    draft.kind, draft.cleanup = kind, []
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False, exclude=r"^_CleanupDraft$")
    ids, aux = torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 8)
    with torch.inference_mode():
        with dd.manual_pass():
            lazy = draft(ids, aux)
            lazy.send(None)  # one step, in pass 0: its calls are pass 0's
        with dd.manual_pass():
            e = target.embed(ids + 7)
            lazy = None  # dropped unconsumed inside pass 1
            ran_in_pass = len(draft.cleanup)
        first = draft.fc(torch.cat([target.embed(ids), aux], -1))
    assert ran_in_pass == 0 and len(draft.cleanup) == 1  # closed after the pass, not lost
    assert dd.close()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    assert sorted(ds.load("draft", 0, 0)) == ["embed", "fc"] and same_bits(ds.load("draft", 0, 0)["fc"], first)
    dumped = ds.load("draft", 0, 1)
    assert list(dumped) == ["embed"] and same_bits(dumped["embed"], e)
    assert not cli_dump.verify_dump(str(tmp_path)).problems


class _LazyLM(torch.nn.Module):
    """A root whose forward returns a generator of LM-head steps, whose ``finally`` calls the LM head
    again (a cleanup step); ``on_forward`` runs first in each forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.embed = torch.nn.Embedding(50, 8)
        self.lm_head = torch.nn.Linear(8, 50, bias=False)
        self.on_forward = lambda: None
        self.cleanup = []

    def forward(self, ids):
        self.on_forward()
        h = self.embed(ids)

        def steps():
            try:
                for s in range(3):
                    yield self.lm_head(h + s)
            finally:
                self.cleanup.append(self.lm_head(h * 2))

        return steps()


@pytest.mark.parametrize("native_pass", [True, False])
def test_a_lazy_result_dropped_inside_its_own_root_pass_keeps_its_cleanup_out_of_it(tmp_path, monkeypatch,
                                                                                     native_pass):
    """A root_passes=True model whose forward returns a generator: the first, left suspended, is
    dropped inside the model's next forward (its pass): its ``finally`` called the LM head inside
    that pass, read as the forward's own ``lm_head``, verify OK. Now it runs once the pass ended."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native_pass)
    model = _LazyLM()
    d = fastdump.attach(model, tmp_path)
    ids = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])]
    held, ran_in_pass = [], []
    with torch.inference_mode():
        held.append(model(ids[0]))
        next(held[0])
        model.on_forward = lambda: (held.clear(), ran_in_pass.append(len(model.cleanup)))
        second = model(ids[1])
        embeds = [model.embed(i) for i in ids]
    assert ran_in_pass == [0] and len(model.cleanup) == 1
    assert d.close()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    for p in range(2):
        dumped = ds.load(None, 0, p)
        assert "lm_head" not in dumped and same_bits(dumped["embed"], embeds[p]), (p, sorted(dumped))
    assert not cli_dump.verify_dump(str(tmp_path)).problems
    del second


class _AsyncCleanupDraft(_Eagle3Draft):
    """A draft whose forward returns an async generator whose ``finally`` calls the shared LM head."""

    def forward(self, ids, aux):
        async def steps():
            try:
                for s in range(3):
                    await asyncio.sleep(0)
                    yield self.fc(torch.cat([self.embed(ids + s), aux], -1))
            finally:
                self.cleanup.append(self.lm_head(aux))

        return steps()


def test_an_async_generator_dropped_unconsumed_keeps_its_cleanup_out_of_a_pass_open_across_an_await(tmp_path):
    """The draft's async generator, stepped once, is dropped inside a target pass that stays open
    across ``await``s: the event loop's finalizer hook scheduled the real object's ``aclose()``,
    which ran while the loop went on inside that pass, unsuspended: the draft's cleanup call of the
    shared LM head was the target's ``lm_head#1``, complete, verify OK. The loop's hook now gets the
    stand-in, whose ``aclose()`` steps suspend the target's pass as every other draft step does."""
    target = _Eagle3Target()
    draft = _AsyncCleanupDraft(target)
    draft.cleanup = []
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False, exclude=r"^_AsyncCleanupDraft$")
    ids, aux, got = torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 8), {}
    hooks = sys.get_asyncgen_hooks()

    async def serve():
        loop_hooks = sys.get_asyncgen_hooks()  # the event loop's own, before any step swapped them
        lazy = draft(ids, aux)
        await lazy.__anext__()  # one step, outside any pass
        got["hooks back after the step"] = sys.get_asyncgen_hooks() == loop_hooks
        with dt.manual_pass():
            got["logits"] = target(ids)
            lazy = None  # dropped unconsumed: the loop closes it at its next turns, inside this pass
            for _ in range(5):
                await asyncio.sleep(0)
            got["cleanups in the pass"] = len(draft.cleanup)
        got["hooks kept"] = sys.get_asyncgen_hooks() == loop_hooks

    with torch.inference_mode():
        asyncio.run(serve())
        e = target.embed(ids)
        h = target.layer(e)
    assert got["cleanups in the pass"] == 1 and got["hooks kept"] and sys.get_asyncgen_hooks() == hooks
    assert got["hooks back after the step"]
    assert same_bits(draft.cleanup[0], target.lm_head(aux).detach())
    assert dd.close()["status"] == "closed" and dt.close()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    want = {"embed": e, "layer": h, "lm_head": got["logits"], "_Eagle3Target": got["logits"]}
    assert sorted(dumped) == sorted(want) and all(same_bits(dumped[n], want[n]) for n in want)
    assert ds.meta("target", 0, 0)["suspended_for"] == [{"role": "draft", "pass": None}]
    assert not cli_dump.verify_dump(str(tmp_path)).problems


def test_an_async_generators_cleanup_run_inside_its_own_dumpers_pass_marks_that_pass_mixed(tmp_path):
    """Dropped unconsumed while a pass of its own Dumper is open across ``await``s, the async
    generator's ``aclose()`` runs when the loop gets to it, inside that pass (it cannot be put off as a
    generator's close is): its cleanup call of the LM head was read as the pass's own ``lm_head``,
    verify OK. The pass is now marked mixed saying so, and verify fails naming it."""
    target = _Eagle3Target()
    draft = _AsyncCleanupDraft(target)
    draft.cleanup = []
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=False, exclude=r"^_AsyncCleanupDraft$")
    ids, aux = torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 8)

    async def serve():
        lazy = draft(ids, aux)
        with dd.manual_pass():
            await lazy.__anext__()  # pass 0: its own step
        with dd.manual_pass():
            lazy = None
            for _ in range(5):
                await asyncio.sleep(0)
        with dd.manual_pass():
            target.embed(ids)  # pass 2: whole

    with torch.inference_mode():
        asyncio.run(serve())
    assert len(draft.cleanup) == 1
    assert dd.close()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    assert [ds.meta("draft", 0, p)["complete"] for p in range(3)] == [True, False, True]
    assert "async generator dropped unconsumed" in ds.meta("draft", 0, 1)["incomplete"]
    problems = cli_dump.verify_dump(str(tmp_path)).problems
    assert len(problems) == 1 and "pass 1 mixes" in problems[0] and "async generator" in problems[0], problems


def test_a_lazy_result_of_a_closed_dumper_dropped_in_a_pass_of_its_models_next_dumper_stays_out_of_it(tmp_path):
    """Attach, step a draft generator, close, attach the draft again: the first session's generator,
    dropped unconsumed inside a pass of the second Dumper, ran its cleanup (the LM head) there, read as
    that pass's own ``lm_head``, verify OK. It is now closed as the second Dumper's own dropped
    result: after that pass, outside it."""
    target = _Eagle3Target()
    draft = _CleanupDraft(target)
    draft.cleanup = []
    ids, aux = torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 8)
    first = fastdump.attach(draft, tmp_path, role="draft", root_passes=False, exclude=r"^_CleanupDraft$")
    with torch.inference_mode():
        lazy = draft(ids, aux)
        lazy.send(None)
        assert first.close()["status"] == "closed"
        second = fastdump.attach(draft, tmp_path, role="draft", root_passes=False, exclude=r"^_CleanupDraft$")
        with second.manual_pass():
            e = target.embed(ids)
            lazy = None
            ran_in_pass = len(draft.cleanup)
    assert ran_in_pass == 0 and len(draft.cleanup) == 1
    assert second.close()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    sessions = ds.sessions("draft")
    assert len(sessions) == 2 and ds.passes("draft", sessions[0]) == []
    dumped = ds.load("draft", sessions[1], 0)
    assert list(dumped) == ["embed"] and same_bits(dumped["embed"], e)
    assert not cli_dump.verify_dump(str(tmp_path)).problems
