"""Ranks in real multi-process runs (torch.distributed, gloo on CPU) and from launcher variables:
each process's rank directory and rank.json, TP=2 dumps against TP=1, roles, roots per node and a
rank killed mid-run. Every dumped value is checked bit for bit against what its process computed."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import fastdump
from fastdump.capture import resolve_ranks
from fastdump.cli import dump as cli_dump

from conftest import same_bits

pytest.importorskip("torch.distributed")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no gloo backend", allow_module_level=True)


# One process of a run: {"root", "refs", "world", "rank", "port", "attach": [kwargs per rank],
# "tp": shards of the MLP, "corrupt": rank whose shard is nudged, "roles", "kill": [rank, step]}.
# It saves what each module returned (torch.save) for the parent to compare with the dump.
WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    import fastdump

    cfg = json.loads(sys.argv[1])
    rank, world, tp = cfg["rank"], cfg["world"], cfg.get("tp", 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    class Col(nn.Module):  # column-parallel: this rank's rows of the weight
        def __init__(self, w, b, k):
            super().__init__()
            n = w.shape[0] // tp
            rows = slice(k * n, (k + 1) * n)
            self.weight, self.bias = nn.Parameter(w[rows].clone()), nn.Parameter(b[rows].clone())
        def forward(self, x):
            return nn.functional.linear(x, self.weight, self.bias)

    class Row(nn.Module):  # row-parallel: this rank's columns, partial sums all-reduced
        def __init__(self, w, b, k):
            super().__init__()
            n = w.shape[1] // tp
            self.weight, self.bias = nn.Parameter(w[:, k * n:(k + 1) * n].clone()), nn.Parameter(b.clone())
        def forward(self, x):
            y = nn.functional.linear(x, self.weight)
            if tp > 1:
                dist.all_reduce(y)
            return y + self.bias

    class Mlp(nn.Module):
        def __init__(self, seed, k):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            w1, b1, w2, b2 = (torch.randn(16, 8, generator=g), torch.randn(16, generator=g),
                              torch.randn(8, 16, generator=g), torch.randn(8, generator=g))
            self.up, self.act, self.down = Col(w1, b1, k), nn.ReLU(), Row(w2, b2, k)
        def forward(self, x):
            return self.down(self.act(self.up(x)))

    k = rank % tp
    models = {role: Mlp(seed, k) for seed, role in enumerate(cfg.get("roles", ["target"]))}
    if cfg.get("corrupt") == rank:
        with torch.no_grad():
            models["target"].up.weight[1, 2] += 0.5
    dumpers = [fastdump.attach(m, cfg["root"], role=role, segment_passes=2, **cfg["attach"][rank])
               for role, m in models.items()]
    refs = {role: [] for role in models}
    for role, m in models.items():
        for name, mod in m.named_modules():
            mod.register_forward_hook(lambda mod, i, o, role=role, name=name or "Mlp":
                                      refs[role].append((name, o.detach().clone())))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(3, 8, generator=g)
            for m in models.values():
                m(x)
            if cfg.get("kill", [None])[0] == rank and step == cfg["kill"][1]:
                torch.save(refs, os.path.join(cfg["refs"], f"{rank}.pt"))
                deadline = time.time() + 30  # the passes ended so far on disk, then killed
                while time.time() < deadline and not all(d._passes_on_disk() > step for d in dumpers):
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
    torch.save(refs, os.path.join(cfg["refs"], f"{rank}.pt"))
    for d in dumpers:
        d.close()
    dist.destroy_process_group()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(tmp_path, root, world, attach=None, **cfg):
    """Runs ``world`` processes of WORKER; returns their exit codes and each rank's reference."""
    refs = tmp_path / f"refs-{os.path.basename(root)}"
    refs.mkdir(exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        one = dict(cfg, root=str(root), refs=str(refs), world=world, rank=rank, port=port,
                   attach=attach or [{}] * world)
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(one)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    codes = [p.returncode for p in procs]
    for code, (_, err) in zip(codes, outs):
        assert code in (0, -signal.SIGKILL), err[-3000:]
    return codes, [torch.load(refs / f"{rank}.pt") for rank in range(world)]


def passes_of(ref):
    """A worker's reference: [(name, tensor)] per forward, split into passes at the root's output."""
    out, cur = [], {}
    for name, t in ref:
        cur[name] = t
        if name == "Mlp":
            out.append(cur)
            cur = {}
    return out


def assert_dump_is(ds, role, rank, ref):
    passes = passes_of(ref)
    assert ds.passes(role, rank) == list(range(len(passes)))
    for p, want in enumerate(passes):
        dumped = ds.load(role, rank, p)
        assert list(dumped) == list(want), (role, rank, p)
        for name, t in want.items():
            assert same_bits(dumped[name], t), (role, rank, p, name)


def rank_dirs(root, role="target"):
    """{directory name prefix (TP.._PP.._Rank..): rank.json's rank object} of every rank directory."""
    out = {}
    for d in sorted((root / role).iterdir()):
        prefix = "_".join(d.name.split("_")[:3])
        out[prefix] = json.loads((d / "rank.json").read_text())["rank"]
    return out


def numbers(tp, tp_size, pp=0, pp_size=1, dp=0, dp_size=1):
    return {"tp_rank": tp, "tp_size": tp_size, "pp_rank": pp, "pp_size": pp_size, "dp_rank": dp,
            "dp_size": dp_size, "ep_rank": 0, "ep_size": 1, "rank": tp_size * pp + tp}


# ------------------------------------------------------------------------------ ranks from the world


def test_pp_stages_and_tp_x_pp_take_their_tp_rank_from_the_world_not_the_world_rank(tmp_path):
    """Two PP stages in a torch.distributed world of 2 (attach(pp_rank=, pp_size=2)) took the world's
    rank and size as their TP rank and size: stage 1 became TP1_PP1_Rank3 of TP size 2, a rank that
    does not exist, and diff and export read a TP=2 stage with a TP rank missing. Now TP is what the
    world holds beside the PP stages (world / pp_size), its rank the world rank modulo that."""
    root = tmp_path / "pp"
    _, refs = run_world(tmp_path, root, 2, attach=[{"pp_rank": r, "pp_size": 2} for r in range(2)])
    assert rank_dirs(root) == {"TP0_PP0_Rank0": numbers(0, 1, 0, 2), "TP0_PP1_Rank1": numbers(0, 1, 1, 2)}
    ds = fastdump.open(root)
    for rank in range(2):
        assert_dump_is(ds, "target", rank, refs[rank]["target"])
    assert not cli_dump.verify_dump(str(root)).problems

    root = tmp_path / "tp2pp2"
    _, refs = run_world(tmp_path, root, 4, tp=2, attach=[{"pp_rank": r // 2, "pp_size": 2} for r in range(4)])
    assert rank_dirs(root) == {f"TP{r % 2}_PP{r // 2}_Rank{r}": numbers(r % 2, 2, r // 2, 2) for r in range(4)}
    ds = fastdump.open(root)
    for rank in range(4):
        assert_dump_is(ds, "target", rank, refs[rank]["target"])


def test_dp_replicas_and_explicit_ranks_override_the_world(tmp_path):
    """DP replicas give tp_size (the world cannot say which processes are TP ranks); explicit
    tp_rank=/tp_size= win over torch.distributed."""
    root = tmp_path / "dp"
    _, refs = run_world(tmp_path, root, 2, attach=[{"tp_size": 1, "dp_rank": r, "dp_size": 2} for r in range(2)])
    dirs = sorted((root / "target").iterdir())
    got = sorted(json.loads((d / "rank.json").read_text())["rank"]["dp_rank"] for d in dirs)
    assert [d.name.split("_")[:3] for d in dirs] == [["TP0", "PP0", "Rank0"]] * 2 and got == [0, 1]
    ds = fastdump.open(root)
    for d in dirs:
        info = json.loads((d / "rank.json").read_text())["rank"]
        assert info == numbers(0, 1, dp=info["dp_rank"], dp_size=2)
        assert_dump_is(ds, "target", d.name, refs[info["dp_rank"]]["target"])

    root = tmp_path / "explicit"
    run_world(tmp_path, root, 2, attach=[{"tp_rank": 1 - r, "tp_size": 2} for r in range(2)])
    assert rank_dirs(root) == {"TP0_PP0_Rank0": numbers(0, 2), "TP1_PP0_Rank1": numbers(1, 2)}


@pytest.fixture
def world(monkeypatch):
    """A torch.distributed world of (rank, size), as resolve_ranks sees it, without processes."""
    import torch.distributed as dist

    def set_world(rank, size):
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda *a: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda *a: size)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TP_RANK", "TP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return set_world


@pytest.mark.parametrize("rank, size, given, want", [
    (1, 2, {"pp_rank": 1, "pp_size": 2}, numbers(0, 1, 1, 2)),
    (3, 4, {"pp_rank": 1, "pp_size": 2}, numbers(1, 2, 1, 2)),
    (3, 4, {"pp_size": 2}, numbers(1, 2, 1, 2)),  # the world is one replica: its rank says the stage
    (3, 4, {"tp_size": 2, "dp_rank": 1, "dp_size": 2}, numbers(1, 2, dp=1, dp_size=2)),
    (3, 4, {"tp_size": 2, "pp_size": 2}, numbers(1, 2, 1, 2)),
    (1, 2, {"tp_rank": 0, "tp_size": 1}, numbers(0, 1)),
    (1, 2, {"tp_rank": 0, "tp_size": 1, "pp_size": 2}, numbers(0, 1, 1, 2)),  # explicit TP, stage from the world
    (1, 2, {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 2}, numbers(0, 1, 0, 2)),  # all explicit
])
def test_ranks_from_a_world(world, rank, size, given, want):
    world(rank, size)
    assert resolve_ranks(**given) == want


@pytest.mark.parametrize("rank, size, given, words", [
    (1, 2, {"dp_rank": 1, "dp_size": 2}, "dp_size=2 without tp_size"),
    (3, 4, {"tp_size": 3}, "world of 4 processes is not tp_size * pp_size = 3 * 1"),
    (1, 3, {"pp_rank": 0, "pp_size": 2}, "pp_size=2 does not divide torch.distributed's world of 3"),
    (1, 2, {"pp_rank": 0, "pp_size": 2}, "pp_rank=0 disagrees with rank 1"),
    (2, 4, {"tp_size": 2}, "world of 4 processes is not tp_size * pp_size = 2 * 1"),
    (0, 2, {"tp_rank": 2}, "tp_rank=2 is outside tp_size=2"),
    (1, 4, {"tp_size": 1, "pp_size": 2, "dp_size": 2}, "pp_size=2 without pp_rank"),
])
def test_ranks_a_world_leaves_ambiguous_are_refused(world, rank, size, given, words):
    """Before, each of these gave some process a directory of another rank, or of none (3 of a
    TP size 3 in a world of 4 while rank 3 failed; a replica's rank as a TP rank)."""
    world(rank, size)
    with pytest.raises(ValueError, match=words.replace("*", r"\*").replace("(", r"\(")):
        resolve_ranks(**given)


@pytest.mark.parametrize("given, words", [
    ({"tp_size": 0}, "tp_size must be an integer >= 1, not 0"),
    ({"pp_size": 0}, "pp_size must be an integer >= 1, not 0"),
    ({"dp_size": 0}, "dp_size must be an integer >= 1, not 0"),
    ({"ep_size": 0}, "ep_size must be an integer >= 1, not 0"),
    ({"tp_rank": -1, "tp_size": 2}, "tp_rank must be an integer >= 0, not -1"),
])
def test_a_size_of_zero_or_a_negative_rank_is_refused_not_read_as_unset(world, given, words):
    """A size of 0 given by code (attach(tp_size=0)) is refused, never taken as "not given" (it
    became size 1 and the rank's directory claimed a world it is not in)."""
    with pytest.raises(ValueError, match=re.escape(words)):
        resolve_ranks(**given)


@pytest.mark.parametrize("env, want", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, numbers(1, 2)),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, numbers(1, 2)),  # one node, no WORLD_SIZE
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, numbers(1, 2)),  # one node, the world
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, numbers(0, 1)),
    ({"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, numbers(9, 16)),  # RANK wins
    ({"RANK": "0"}, numbers(0, 1)),
    ({"TP_RANK": "1", "TP_SIZE": "2", "RANK": "5", "WORLD_SIZE": "8"}, numbers(1, 2)),
    ({"RANK": "3", "WORLD_SIZE": "4", "PP": "2"}, numbers(1, 2, 1, 2)),
    ({"RANK": "", "WORLD_SIZE": "", "LOCAL_RANK": "", "TP_RANK": ""}, numbers(0, 1)),  # set empty: unset
])
def test_ranks_from_launcher_variables(world, monkeypatch, env, want):
    pp = env.pop("PP", None)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resolve_ranks(**({"pp_size": int(pp)} if pp else {})) == want


@pytest.mark.parametrize("env, words", [
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not an integer >= 0"),
    ({"RANK": "1.5", "WORLD_SIZE": "2"}, "RANK='1.5' is not an integer >= 0"),
    ({"RANK": "1", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not an integer >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK=1 is set but RANK, WORLD_SIZE and LOCAL_WORLD_SIZE are not"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"},
     "LOCAL_RANK=1 is set without RANK, with WORLD_SIZE=2 and LOCAL_WORLD_SIZE is not set"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "16"},
     "LOCAL_RANK=0 is set without RANK, with WORLD_SIZE=16 and LOCAL_WORLD_SIZE is not set"),
])
def test_bad_launcher_variables_are_refused_naming_the_variable(world, monkeypatch, tmp_path, env, words):
    """RANK=-1 was refused as "tp_rank must be an integer >= 0", WORLD_SIZE alone made every process
    rank 0 of a TP group. Now attach refuses them naming the variable, before anything is created."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        fastdump.attach(torch.nn.Linear(2, 2), tmp_path / "dump")
    assert not (tmp_path / "dump").exists()


def test_local_rank_of_two_nodes_is_refused_and_of_one_node_dumps_its_own_rank(world, monkeypatch, tmp_path):
    """A launcher of 2 nodes x 8 setting LOCAL_RANK=1, WORLD_SIZE=16 (no RANK) made the process of
    each node TP rank 1 of 16: the two nodes' data went to one rank directory name (one shared root)
    and global rank 9 had none. Now attach refuses it naming the variables, creating nothing; a
    LOCAL_RANK on a node that is the whole world (LOCAL_WORLD_SIZE = WORLD_SIZE) is that rank."""
    for name, value in {"LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="LOCAL_RANK=1 is set without RANK, with WORLD_SIZE=16 and "
                                         "LOCAL_WORLD_SIZE=8: .* set RANK"):
        fastdump.attach(torch.nn.Linear(2, 2), tmp_path / "dump")
    assert not (tmp_path / "dump").exists()

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model, x = torch.nn.Linear(2, 3), torch.randn(4, 2)
    with fastdump.attach(model, tmp_path / "dump"):
        with torch.no_grad():
            want = model(x)
    assert rank_dirs(tmp_path / "dump") == {"TP1_PP0_Rank1": numbers(1, 2)}
    assert same_bits(fastdump.open(tmp_path / "dump").load("target", 1, 0)["Linear"], want)


# ------------------------------------------------------------------------ TP=2 against TP=1, roles


def test_tp2_dump_diffs_clean_against_tp1_and_a_corrupt_shard_is_named(tmp_path):
    """A column-parallel then row-parallel (all_reduce) MLP in two processes: each rank's dump is
    what it computed, it unshards to the TP=1 run, and one rank's nudged shard is found at its
    module and rank: against TP=1 the merged row says whose shard differs, against TP=2 the row
    is the rank's."""
    _, ref1 = run_world(tmp_path, tmp_path / "tp1", 1)
    _, ref2 = run_world(tmp_path, tmp_path / "tp2", 2, tp=2)
    _, bad = run_world(tmp_path, tmp_path / "bad", 2, tp=2, corrupt=1)
    assert rank_dirs(tmp_path / "tp2") == {"TP0_PP0_Rank0": numbers(0, 2), "TP1_PP0_Rank1": numbers(1, 2)}
    for root, refs in (("tp1", ref1), ("tp2", ref2), ("bad", bad)):
        ds = fastdump.open(tmp_path / root)
        for rank, ref in enumerate(refs):
            assert_dump_is(ds, "target", rank, ref["target"])
    # The column-parallel shards concatenate to the TP=1 output; down's are replicated (all_reduce).
    ds1, ds2 = fastdump.open(tmp_path / "tp1"), fastdump.open(tmp_path / "tp2")
    whole = torch.cat([ds2.load("target", 0, 0)["up"], ds2.load("target", 1, 0)["up"]], dim=1)
    assert torch.allclose(whole, ds1.load("target", 0, 0)["up"], atol=1e-6, rtol=0)

    result = fastdump.diff(str(tmp_path / "tp1"), str(tmp_path / "tp2"))
    assert result.ok and result.compared == 16, result.to_json()
    assert {row["unshard"] for row in json.loads(result.to_json())["rows"]} == {1, "replicated"}

    # Merged, the row names no rank (dp0:merged): it says whose shard differs. It did not.
    result = fastdump.diff(str(tmp_path / "tp1"), str(tmp_path / "bad"))
    first = result.first_divergence
    assert not result.ok and (first["name"], first["pass"], first["rank"]) == ("up", 0, "dp0:merged")
    assert first["failing_tp_ranks"] == {"target": [1]} and "(in the shard of target tp rank 1)" in first["reason"]
    result = fastdump.diff(str(tmp_path / "bad"), str(tmp_path / "tp1"))
    assert result.first_divergence["failing_tp_ranks"] == {"baseline": [1]}
    result = fastdump.diff(str(tmp_path / "tp2"), str(tmp_path / "bad"))
    assert not result.ok
    assert (result.first_divergence["name"], result.first_divergence["rank"]) == ("up", 1)
    failing = {(row["rank"], row["name"]) for row in json.loads(result.to_json())["rows"] if row["status"] != "ok"}
    assert (0, "up") not in failing and (1, "up") in failing


def test_two_roles_in_two_ranks_and_one_root_per_node(tmp_path):
    """target and draft in each of 2 ranks: ls, verify and open list and load every (role, rank);
    the ranks' directories split into one root per node read back as one dump."""
    root = tmp_path / "both"
    _, refs = run_world(tmp_path, root, 2, tp=2, roles=["target", "draft"])
    listing = subprocess.run([sys.executable, "-m", "fastdump", "ls", str(root), "--json"], capture_output=True,
                             text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)["ranks"]
    seen = sorted((r["role"], r["rank"].split("_")[2], r["passes"], r["status"]) for r in rows)
    assert seen == [(role, f"Rank{k}", 4, "closed") for role in ("draft", "target") for k in (0, 1)]
    assert not cli_dump.verify_dump(str(root), read_data=True).problems

    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for k, node in enumerate(nodes):
        for role in ("target", "draft"):
            (node / role).mkdir(parents=True)
            (d,) = [d for d in (root / role).iterdir() if d.name.startswith(f"TP{k}_")]
            os.rename(d, node / role / d.name)
    ds = fastdump.open(nodes)
    assert ds.roles == ["draft", "target"]
    for rank in range(2):
        for role in ("target", "draft"):
            assert ds.rank_info(role, rank)["rank"] == numbers(rank, 2)
            assert_dump_is(ds, role, rank, refs[rank][role])
    with pytest.raises(ValueError):  # the same rank in two roots is refused, never merged
        fastdump.open([nodes[0], nodes[0]])


def test_a_rank_killed_mid_run_fails_verify_by_name_and_the_others_are_whole(tmp_path):
    root = tmp_path / "killed"
    codes, refs = run_world(tmp_path, root, 2, kill=[1, 1])
    assert codes == [0, -signal.SIGKILL]
    report = cli_dump.verify_dump(str(root))
    assert report.problems and all("TP1_PP0_Rank1" in p for p in report.problems), report.problems
    ds = fastdump.open(root)
    assert ds.rank_info("target", 0)["status"] == "closed"
    assert ds.rank_info("target", 1)["status"] == "incomplete"
    assert_dump_is(ds, "target", 0, refs[0]["target"])
    assert ds.passes("target", 1) == [0, 1]  # everything handed to its writer before the kill
    assert_dump_is(ds, "target", 1, refs[1]["target"])
