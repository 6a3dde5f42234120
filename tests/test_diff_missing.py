"""What ``fastdump diff`` did not compare: names and passes on one side only, in bounded memory,
and ``--strict``, which fails the diff for them (a regression script must not pass a run that
stopped dumping half its modules)."""

import json
import os

import pytest
import torch

import fastdump
from fastdump import cli

from conftest import write_rank_dir


def crafted(root, passes):
    """A one-rank dump of ``{pass_id: {name: tensor}}``."""
    write_rank_dir(os.path.join(root, "target", "TP0_PP0_Rank0_pid100"), passes, segment_passes=500)
    return str(root)


def run(capsys, *argv):
    code = cli.main(["diff", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def target_writer_of_x_and_y(rank_path):
    """A ChannelWriter for a target rank directory (pid 100, one rank) that knows the names 'x'
    (id 0) and 'y' (id 1): the tests below write passes with drops and skips through it."""
    from fastdump.writer.channel_writer import ChannelWriter

    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(rank_path), "role": "target",
                            "rank": {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0},
                            "pid": 100, "host": "h", "device": {}, "config": {}})
    writer.on_name(0, "x")
    writer.on_name(1, "y")
    return writer


def write_ones(writer, pass_id, name_ids):
    """Stores torch.ones(2) (float32) under each of ``name_ids`` in ``pass_id``."""
    from fastdump import dtypes

    for index in name_ids:
        writer.on_tensor(index, pass_id, dtypes.code_of(torch.float32), (2,),
                         torch.ones(2).view(torch.uint8).numpy().copy())


@pytest.fixture
def one_sided(tmp_path):
    """Baseline passes 0-5 of 'x'; target passes 0-9 of 'x', and 'y' in its odd passes."""
    base = crafted(tmp_path / "b", {p: {"x": torch.ones(2)} for p in range(6)})
    target = crafted(tmp_path / "t", {p: {"x": torch.ones(2), **({"y": torch.ones(1)} if p % 2 else {})}
                                      for p in range(10)})
    return base, target


def test_strict_fails_on_names_and_passes_on_one_side_only(one_sided, capsys):
    base, target = one_sided
    code, out, _ = run(capsys, base, target)
    assert code == 0  # the default: listed, not failed
    lines = out.splitlines()
    assert lines[0] == ("no divergence in the 6 tensor(s) compared (atol 1e-05, rtol 1e-05); not compared: "
                        "1 name(s) and 4 pass(es) on one side only (listed below)")
    assert "missing: role target rank 0: passes 6-9 (4 passes) only in the target" in lines
    assert "missing: role target rank 0: 'y' only in the target (passes 1,3,5)" in lines
    code, out, _ = run(capsys, base, target, "--strict")
    assert code == 1
    assert out.splitlines()[0].endswith("on one side only (listed below; --strict: the diff fails)")
    result = fastdump.diff(base, target, strict=True)
    assert (result.exit_code, result.ok, result.options.as_dict()["strict"]) == (1, False, True)
    assert json.loads(result.to_json())["exit_code"] == 1
    # Everything compared on both sides: --strict passes.
    code, out, _ = run(capsys, base, target, "--strict", "--passes", "0", "--name", "x")
    assert code == 0 and out.splitlines()[0].startswith("no divergence: 1 tensor(s) compared")


def test_passes_outside_the_passes_option_are_not_missing(one_sided):
    """--passes 0-3: target passes 6-9 were not asked about; listed missing, they failed --strict."""
    base, target = one_sided
    result = fastdump.diff(base, target, passes="0-3", strict=True)
    assert [m for m in result.missing if m["kind"] == "passes"] == []
    assert [(m["name"], m["pass_count"], m["pass_ranges"]) for m in result.missing] == [("y", 2, [[1, 1], [3, 3]])]
    result = fastdump.diff(base, target, passes="0-3", name="x", strict=True)
    assert result.missing == [] and result.exit_code == 0
    # offset:1 pairs baseline p with target p+1: baseline pass 5 stands for target 6, outside 0-3.
    shifted = fastdump.diff(base, target, passes="0-3", align="offset:1", name="x")
    assert shifted.missing == [{"kind": "passes", "only_in": "target", "role": "target", "rank": 0, "passes": [0]}]
    # order: the target's passes past the baseline's are still missing where selected.
    in_order = fastdump.diff(base, target, passes="0-2,8", align="order", name="x")
    assert in_order.missing == [{"kind": "passes", "only_in": "target", "role": "target", "rank": 0, "passes": [8]}]


def test_align_order_lists_baseline_passes_past_the_targets_last_where_passes_selects_them(tmp_path):
    """--align order with --passes listed no baseline pass past the target's last, even for an open
    '--passes 0-' that asks about every pass. Such a pass stands for the ids the target would give
    its next passes (last + 1, ...)."""
    base = crafted(tmp_path / "b", {p: {"x": torch.ones(2)} for p in range(10)})
    target = crafted(tmp_path / "t", {p: {"x": torch.ones(2)} for p in range(6)})
    only_base = {"kind": "passes", "only_in": "baseline", "role": "target", "rank": 0}
    assert fastdump.diff(base, target, align="order").missing == [{**only_base, "passes": [6, 7, 8, 9]}]
    assert fastdump.diff(base, target, align="order", passes="0-").missing == [{**only_base, "passes": [6, 7, 8, 9]}]
    assert fastdump.diff(base, target, align="order", passes="0-2,8").missing == [{**only_base, "passes": [8]}]
    assert fastdump.diff(base, target, align="order", passes="0-3").missing == []


def test_align_offset_selects_a_baseline_only_pass_by_the_target_id_it_stands_for(tmp_path):
    """--align offset:1 pairs baseline p with target p + 1: baseline passes 5-9 have no target
    pass and stand for target ids 6-10, so '--passes 0-6' (target ids) asks about 5 only."""
    base = crafted(tmp_path / "b", {p: {"x": torch.ones(2)} for p in range(10)})
    target = crafted(tmp_path / "t", {p: {"x": torch.ones(2)} for p in range(6)})
    where = {"kind": "passes", "role": "target", "rank": 0}
    result = fastdump.diff(base, target, align="offset:1", passes="0-6")
    assert result.missing == [{**where, "only_in": "baseline", "passes": [5]}, {**where, "only_in": "target", "passes": [0]}]
    assert result.compared == 5 and result.failed == 0


def test_pass_runs_keep_count_and_ends_in_bounded_memory():
    from fastdump.report import PassRuns, _runs_text

    runs = PassRuns(range(0, 200000, 2))
    item = runs.as_item()
    assert item["pass_count"] == 100000
    assert item["pass_ranges"] == [[k, k] for k in range(0, 16, 2)] + [[199998, 199998]]
    assert item["pass_ranges_elided"] == 100000 - 9
    assert _runs_text(item) == "0,2,4,6,8,10,12,14,… 99991 more ranges …,199998 (100000 passes)"
    assert _runs_text(PassRuns([0, 1, 2, 5, 6, 9]).as_item()) == "0-2,5,6,9 (6 passes)"
    assert _runs_text(PassRuns([4]).as_item()) == "4"


def test_names_missing_in_many_passes_stay_bounded(tmp_path):
    """40 names in every other pass of the target only: what the result holds of them does not
    grow with the passes (it held every pass id: passes x names)."""
    def missing_json(passes):
        base = crafted(tmp_path / f"b{passes}", {p: {"x": torch.ones(1)} for p in range(passes)})
        target = crafted(tmp_path / f"t{passes}", {p: {"x": torch.ones(1), **{f"n{k}": torch.ones(1) for k in range(40)
                                                                             if p % 2}} for p in range(passes)})
        result = fastdump.diff(base, target)
        assert result.exit_code == 0 and result.compared == passes  # x
        assert len(result.missing) == 40
        for item in result.missing:
            assert item["pass_count"] == passes // 2
            assert item["pass_ranges"] == [[k, k] for k in range(1, 17, 2)] + [[passes - 1, passes - 1]]
            assert item["pass_ranges_elided"] == passes // 2 - 9
        return json.dumps(result.missing)

    small, large = missing_json(100), missing_json(1000)
    assert len(large) - len(small) <= 40 * 8  # a few more digits per item, never the pass ids


def tp2(root, passes):
    """A TP=2 dump: each rank holds ``{pass_id: {name: tensor}}``."""
    for tp in range(2):
        write_rank_dir(os.path.join(root, "target", f"TP{tp}_PP0_Rank{tp}_pid100"), passes,
                       rank={"tp_rank": tp, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "rank": tp})
    return str(root)


def test_a_pass_on_one_side_counts_once_whatever_the_tp_ranks(tmp_path, capsys):
    base = tp2(tmp_path / "b", {p: {"x": torch.ones(2)} for p in range(3)})
    target = tp2(tmp_path / "t", {p: {"x": torch.ones(2)} for p in range(5)})
    code, out, _ = run(capsys, base, target)
    lines = out.splitlines()
    assert code == 0 and lines[0] == ("no divergence in the 6 tensor(s) compared (atol 1e-05, rtol 1e-05); not "
                                      "compared: 2 pass(es) on one side only (listed below)")  # it said 4
    assert lines[1:3] == ["missing: role target rank 0: passes 3,4 only in the target",
                          "missing: role target rank 1: passes 3,4 only in the target"]


def test_passes_selecting_nothing_says_so_not_that_the_dumps_share_no_pass(one_sided, capsys):
    base, target = one_sided
    code, out, err = run(capsys, base, target, "--passes", "7-9")
    assert code == 2 and out == ""
    assert err == ("fastdump diff: --passes '7-9' selects none of the 6 target pass(es) paired with a baseline "
                   "pass (target pass ids 0-5 (6 passes))\n")
    # Passes truly not shared still say so.
    code, out, err = run(capsys, base, target, "--align", "offset:50")
    assert code == 2 and err.startswith("fastdump diff: no passes in common")


def test_what_the_capture_side_dropped_is_noted_not_blamed_on_the_model(tmp_path, capsys):
    """Pass 3 dropped whole and 'y' of pass 1 dropped by the target's ring: diff listed them only in
    the baseline, as if the target model had not run them, and said nothing of the drops."""
    base = crafted(tmp_path / "b", {p: {"x": torch.ones(2), "y": torch.ones(2)} for p in range(4)})
    rank_path = tmp_path / "t" / "target" / "TP0_PP0_Rank0_pid100"
    writer = target_writer_of_x_and_y(rank_path)
    for pass_id in (0, 1, 2):
        writer.on_begin(pass_id, {})
        write_ones(writer, pass_id, (0,) if pass_id == 1 else (0, 1))
        writer.on_end(pass_id, {}, 1 if pass_id == 1 else 0, [])
    writer.close({"dropped": 1, "dropped_passes": 1}, status="closed")
    code, out, _ = run(capsys, base, tmp_path / "t")
    lines = out.splitlines()
    assert code == 0
    assert lines[1:3] == ["missing: role target rank 0: passes 3 only in the baseline",
                          "missing: role target rank 0: 'y' only in the baseline (passes 1)"]
    assert lines[3] == (f"note: target {rank_path}: the capture side dropped 1 tensor(s) and 1 whole pass(es) "
                        f"(ring full); names and passes this rank lacks may be data not dumped, not absent from "
                        f"the model")
    assert run(capsys, base, tmp_path / "t", "--strict")[0] == 1


def test_what_the_dumper_counted_at_close_as_not_dumped_is_noted(tmp_path, capsys):
    """A module compiled with fullgraph=True ran undumped (rank.json stats.compiled_not_dumped, which
    verify fails): its name, absent from every target pass, was listed as a name the target model
    did not run, without a note."""
    base = crafted(tmp_path / "b", {p: {"x": torch.ones(2), "y": torch.ones(2)} for p in range(2)})
    rank_path = tmp_path / "t" / "target" / "TP0_PP0_Rank0_pid100"
    write_rank_dir(rank_path, {p: {"x": torch.ones(2)} for p in range(2)}, stats={"compiled_not_dumped": 1})
    code, out, _ = run(capsys, base, tmp_path / "t")
    lines = out.splitlines()
    assert code == 0 and lines[1] == "missing: role target rank 0: 'y' only in the baseline (passes 0,1)"
    assert lines[2] == (f"note: target {rank_path}: the capture side counted at close: 1 dumped module(s) were "
                        f"compiled into graphs that may not break (torch.compile fullgraph=True): their outputs "
                        f"are in no pass; names and passes this rank lacks may be data not dumped, not absent "
                        f"from the model")


def test_a_tensor_lost_after_it_was_accepted_is_noted_as_lost_not_as_skipped(tmp_path, capsys):
    """'y' of pass 1 torn (a failed CUDA drain: accepted, then lost; verify fails the dump) and 'y'
    of pass 2 a real skip: the note said "skipped 2 tensor(s)", as if the capture side had left both
    out by design."""
    from fastdump import format as fmt

    base = crafted(tmp_path / "b", {p: {"x": torch.ones(2), "y": torch.ones(2)} for p in range(3)})
    rank_path = tmp_path / "t" / "target" / "TP0_PP0_Rank0_pid100"
    writer = target_writer_of_x_and_y(rank_path)
    for pass_id in (0, 1, 2):
        writer.on_begin(pass_id, {})
        write_ones(writer, pass_id, (0, 1) if pass_id == 0 else (0,))
        if pass_id == 1:
            writer.skip_tensor(1, pass_id, fmt.TORN_TENSOR_REASON)
        writer.on_end(pass_id, {}, 0, [{"name": "y", "reason": "quantized tensor"}] if pass_id == 2 else [])
    writer.close({}, status="closed")
    code, out, _ = run(capsys, base, tmp_path / "t")
    lines = out.splitlines()
    assert code == 0 and lines[1] == "missing: role target rank 0: 'y' only in the baseline (passes 1,2)"
    assert lines[2] == (f"note: target {rank_path}: the capture side skipped 1 tensor(s) (reasons in each pass's "
                        f"metadata: fastdump show) and lost 1 tensor(s) after they were accepted (torn, or not "
                        f"stored by the writer: fastdump verify fails the dump); names and passes this rank lacks "
                        f"may be data not dumped, not absent from the model")


def test_align_meta_matching_no_pass_says_how_many_passes_had_it(tmp_path, capsys):
    """It said "no passes in common (--align order or meta:KEY=VALUE pairs passes by order)": the
    very option given, and nothing about the metadata that matched nothing."""
    base = crafted(tmp_path / "b", {p: {"x": torch.ones(2)} for p in range(3)})
    target = str(tmp_path / "t")
    write_rank_dir(os.path.join(target, "target", "TP0_PP0_Rank0_pid100"), {p: {"x": torch.ones(2)} for p in range(4)},
                   pass_meta=lambda p: {"forward_mode": "decode" if p else "prefill"})
    code, out, err = run(capsys, base, target, "--align", "meta:forward_mode=decode")
    assert code == 2 and err == ("fastdump diff: --align 'meta:forward_mode=decode': no pass with metadata "
                                 "forward_mode == 'decode' on both sides (baseline 0 of 3 passes, target 3 of 4 "
                                 "passes; role target, rank 0)\n  role target rank 0: passes 1-3 (3 passes) only in "
                                 "the target\n")
    result = fastdump.diff(target, target, align="meta:forward_mode=decode")
    assert (result.exit_code, result.compared) == (0, 3)


def test_passes_spec_is_a_set_not_a_list_walked_per_pass():
    """A script listing 4000 pass ids made each pass test walk the list: 8000 passes took 2.2 s
    (quadratic: minutes on a long dump, and it is asked per unit and per pass). Same answers as the
    spec read literally, now in milliseconds."""
    import random
    import time

    from fastdump.compare import parse_passes

    def literal(spec):  # the spec read as written: each part N, N-M or N-
        def one(part, p):
            first, dash, last = part.partition("-")
            return p == int(first) if not dash else int(first) <= p and (not last or p <= int(last))
        return lambda p: any(one(part, p) for part in spec.split(","))

    rng = random.Random(1)
    for _ in range(300):
        parts = [rng.choice([f"{a}", f"{a}-", f"{a}-{a + rng.randint(0, 9)}"]) for a in
                 (rng.randint(0, 30) for _ in range(rng.randint(1, 6)))]
        spec = ",".join(parts)
        assert [p for p in range(60) if parse_passes(spec)(p)] == [p for p in range(60) if literal(spec)(p)], spec
    wanted = parse_passes(",".join(map(str, range(0, 8000, 2))))
    start = time.monotonic()
    assert sum(map(wanted, range(8000))) == 4000
    assert time.monotonic() - start < 0.5


def test_a_wide_pass_looks_names_up_in_a_set(monkeypatch):
    """Each tensor of a pass was looked for in the list of the pass's names: a pass of 30k tensors
    made 30k x 15k string comparisons per rank (seconds per pass, before any data was read). The
    list is walked once (into a set), however many names are looked up: counted, not timed (a
    1 s limit failed on a loaded machine)."""
    from types import SimpleNamespace

    from fastdump import compare

    class CountedNames(list):
        """The pass's names, counting each walk or search of the whole list."""
        walks = 0

        def __iter__(self):
            CountedNames.walks += 1
            return super().__iter__()

        def __contains__(self, name):
            CountedNames.walks += 1
            return super().__contains__(name)

        def index(self, *args):
            CountedNames.walks += 1
            return super().index(*args)

        def count(self, name):
            CountedNames.walks += 1
            return super().count(name)

    plain = [f"model.layers.{k}.mlp.output" for k in range(30000)]
    ref = SimpleNamespace(path="rank", passes={0}, side="target", rank=0)
    cache = compare._PassCache()
    cache._names[("rank", 0)] = CountedNames(plain)
    monkeypatch.setattr(cache, "tensor", lambda ref, name, pass_id: name)
    assert [compare._read_shards([ref], name, 0, cache) for name in plain] == [[name] for name in plain]
    assert CountedNames.walks == 1  # (the set made of it; a search per name was 30,000)
    with pytest.raises(compare._RowError, match="missing on target rank 0 pass 0"):
        compare._read_shards([ref], "model.layers.30000.mlp.output", 0, cache)


def test_a_root_whose_name_reads_as_a_glob_is_taken_as_it_is(one_sided, tmp_path, capsys):
    """'run[bf16]' exists: diff globbed it (matching 'runb', 'runf'...) and refused it, exit 2."""
    import shutil

    base, _ = one_sided
    literal = tmp_path / "run[bf16]"
    shutil.copytree(base, literal)
    code, out, err = run(capsys, literal, base)
    assert (code, err) == (0, "") and out.splitlines()[-1] == "compared 6, failed 0, missing 0"
    shutil.copytree(base, tmp_path / "runb")  # a glob that matches is still a glob
    code, out, err = run(capsys, "--baseline-root", tmp_path / "run[b]", "--target-root", base)
    assert code == 0 and out.splitlines()[-1] == "compared 6, failed 0, missing 0"


def test_a_side_with_no_pass_in_a_file_yet_is_named(one_sided, tmp_path, capsys):
    """A running rank whose passes are all in its open segment: --allow-running said 'no passes in
    common (--align order or meta:KEY=VALUE pairs passes by order)', blaming the pass numbering."""
    base, _ = one_sided
    write_rank_dir(tmp_path / "running" / "target" / "TP0_PP0_Rank0_pid100", {}, status="running")
    code, out, err = run(capsys, tmp_path / "running", base, "--allow-running")
    assert code == 2 and err == ("fastdump diff: no pass in a segment file on the baseline (a running rank keeps its "
                                 "ended passes in its open segment until the segment is full or the Dumper is "
                                 "closed)\n")


def test_dp_replicas_keep_their_missing_names_and_passes_apart(tmp_path, capsys):
    """Rank numbers repeat per DP replica: a name on one side in both replicas was one item whose
    passes read 0,0,1,1,2,2, and two replicas' extra passes two items that read alike."""
    def dump(root, passes, extra):
        for dp in range(2):  # (DP replicas share rank numbers, so their directory names: pids tell them apart)
            write_rank_dir(root / "target" / f"TP0_PP0_Rank0_pid1{dp}",
                           {p: {"x": torch.ones(2), **({"y": torch.ones(1)} if extra else {})} for p in range(passes)},
                           rank={"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": dp, "rank": 0})
        return root

    code, out, _ = run(capsys, dump(tmp_path / "b", 3, False), dump(tmp_path / "t", 4, True))
    assert code == 0 and out.splitlines() == [
        "no divergence in the 6 tensor(s) compared (atol 1e-05, rtol 1e-05); not compared: 1 name(s) and 2 pass(es) "
        "on one side only (listed below)",
        "missing: role target rank 0 (dp 0): passes 3 only in the target",
        "missing: role target rank 0 (dp 1): passes 3 only in the target",
        "missing: role target rank 0 (dp 0): 'y' only in the target (passes 0-2 (3 passes))",
        "missing: role target rank 0 (dp 1): 'y' only in the target (passes 0-2 (3 passes))",
        "compared 6, failed 0, missing 4"]


def test_a_rank_holding_no_pass_on_one_side_is_data_missing_not_passes_on_one_side(tmp_path, capsys):
    """An EAGLE run whose draft attached but never dumped a pass (speculative decoding off) against
    one whose draft ran: the draft's passes were listed as passes on one side only, "no divergence"
    (exit 0), where a run without the draft role at all exits 1. A rank (its whole DP replica)
    holding no pass while the other side's holds passes the diff asks about is data missing now."""
    x = {"layer": torch.ones(3)}

    def dump(root, draft_passes):
        write_rank_dir(root / "target" / "TP0_PP0_Rank0_pid100", {0: x, 1: x})
        write_rank_dir(root / "draft" / "TP0_PP0_Rank0_pid100", draft_passes, role="draft")
        return root

    ran, idle = dump(tmp_path / "ran", {0: x, 1: x}), dump(tmp_path / "idle", {})
    for base, target, only_in, empty in ((ran, idle, "baseline", "target"), (idle, ran, "target", "baseline")):
        code, out, _ = run(capsys, base, target)
        lines = out.splitlines()
        assert code == 1, out
        assert lines[0] == ("data missing: 1 rank(s) holding no pass on one side only (listed below); the 2 "
                            "tensor(s) compared are within tolerance")
        assert lines[1] == (f"missing: role draft rank 0: no pass on the {empty} "
                            f"({os.path.join(str(tmp_path), 'idle', 'draft', 'TP0_PP0_Rank0_pid100')}), passes 0,1 "
                            f"only in the {only_in}: not compared")
        result = fastdump.diff(base, target)
        assert [(m["kind"], m["role"], m["only_in"], m["passes"]) for m in result.missing] == [
            ("rank_without_passes", "draft", only_in, [0, 1])]
    # Only the passes --passes asks about are listed; the target role alone compares as before.
    assert [m["passes"] for m in fastdump.diff(ran, idle, passes="1").missing] == [[1]]
    assert fastdump.diff(ran, idle, role="target").exit_code == 0


def test_a_pass_the_same_tp_rank_lacks_on_both_sides_is_data_missing(tmp_path, capsys):
    """TP2 against TP2, TP rank 1 without pass 1 on both sides while TP rank 0 ran it: neither side
    had a name for rank 1's pass 1, so nothing was compared nor listed: "no divergence: 5
    tensor(s) compared" (exit 0), where the same loss on the target alone fails the diff."""
    x = {"a": torch.ones(3)}

    def tp2(root, lost):
        for tp in range(2):
            write_rank_dir(root / "target" / f"TP{tp}_PP0_Rank{tp}_pid100",
                           {p: x for p in range(3) if (tp, p) not in lost},
                           rank={"tp_rank": tp, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "rank": tp})
        return root

    base, target = tp2(tmp_path / "b", {(1, 1)}), tp2(tmp_path / "t", {(1, 1)})
    code, out, _ = run(capsys, base, target)
    lines = out.splitlines()
    assert code == 1, out
    assert lines[0] == ("data missing: 1 rank(s) without passes their DP replica ran, on both sides (listed "
                        "below); the 5 tensor(s) compared are within tolerance")
    assert lines[1] == ("missing: role target rank 1: passes 1 missing on both sides' rank (other ranks of its DP "
                        "replica ran them): not compared")
    result = fastdump.diff(base, target)
    assert [(m["kind"], m["rank"], m["passes"]) for m in result.missing] == [("rank_passes", 1, [1])]
    assert fastdump.diff(base, target, passes="0,2").exit_code == 0  # (a pass not asked about)
    assert fastdump.diff(base, target, rank=0).exit_code == 0  # (rank 0 holds every pass)
