"""Smoke tests for benchmarks/: each script's tiny configuration runs, prints its table, writes the
expected JSON; plus cheap content checks (the SGLang-style baseline's files, decode outputs
unchanged by dumping, the speculative loop equal to plain greedy decoding).

fastdump modes must succeed whenever ``import fastdump`` works; without the library they must
report "unavailable" and the rest must still pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import decode_bench, hook_bench, writer_bench  # noqa: E402
from benchmarks.common import import_fastdump  # noqa: E402
from benchmarks.models import PRESETS, ModelConfig, allocate_kv_caches, build_models  # noqa: E402

FASTDUMP, _ = import_fastdump()
FASTDUMP_AVAILABLE = FASTDUMP is not None


def run_script(script: str, *args: str, env_extra: dict | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTDUMP_")}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def check_mode_status(modes: dict, name: str, fastdump_mode: bool) -> bool:
    """True when the mode ran; fastdump modes may be 'unavailable' only without the library."""
    status = modes[name]["status"]
    if fastdump_mode and not FASTDUMP_AVAILABLE:
        assert status == "unavailable", (name, modes[name])
        return False
    assert status == "ok", (name, modes[name])
    return True


# ------------------------------------------------------------------------------------------------
# decode_bench
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode")
    out, result_json, flag_dir = tmp / "dumps", tmp / "decode.json", tmp / "flag"
    stdout = run_script("decode_bench.py", "--tiny", "--out", str(out), "--keep-dumps", "--json", str(result_json),
                        env_extra={"FASTDUMP_DIR": str(flag_dir)})
    return stdout, json.loads(result_json.read_text()), out, flag_dir


def test_decode_bench_table_and_modes(decode_run):
    stdout, result, _out, _flag = decode_run
    expected = set(decode_bench.BASE_MODES) | {"flag"}  # flag: FASTDUMP_DIR was set
    assert set(result["modes"]) == expected
    assert "| mode" in stdout and "step (median)" in stdout
    for mode in expected:
        assert f"| {mode} " in stdout, mode
    for mode, entry in result["modes"].items():
        if not check_mode_status(result["modes"], mode, mode in decode_bench.FASTDUMP_MODES or mode == "flag"):
            continue
        assert entry["bit_exact_vs_none"], f"{mode}: logits differ from the run without dumping"
        for role in ("draft", "target"):
            role_entry = entry["roles"][role]
            assert role_entry["median_step_s"] > 0
            if mode not in ("none", decode_bench.NOOP):  # the no-op wrapper is a reference: it dumps nothing
                assert role_entry["passes_last_rep"] == result["expected_passes"][role], (mode, role, role_entry)
                assert role_entry["bytes_per_s"] > 0
                assert role_entry["error_last_rep"] is None, (mode, role, role_entry)


def test_sglang_style_pass_files(decode_run):
    _stdout, result, out, _flag = decode_run
    last_rep = result["config"]["reps"] - 1
    layers = PRESETS["tiny"].model.num_layers
    for role in ("target", "draft"):
        rank_dirs = list((out / "sglang-style" / f"rep{last_rep}" / role).glob("TP0_PP0_Rank0_pid*"))
        assert len(rank_dirs) == 1, rank_dirs
        files = sorted(rank_dirs[0].glob("Pass*.pt"))
        assert [f.name for f in files] == [f"Pass{i:05d}.pt" for i in range(result["expected_passes"][role])]
        first = torch.load(files[0], weights_only=True)
        second = torch.load(files[1], weights_only=True)
        expected_names = {"model.embed_tokens", "model.norm", "model.layers.0.self_attn.q_proj",
                          "model.layers.0.self_attn.attn", "model.layers.0.mlp.down_proj"}
        assert expected_names <= set(first), sorted(first)
        # SGLang's quirk, reproduced: the top-level and LM-head outputs land in the next pass file.
        assert "lm_head" not in first and "model" not in first
        assert {"lm_head", "model"} <= set(second)
        # Tuple outputs are stored as a list of CPU tensors under one name.
        rotary = first["model.layers.0.self_attn.rotary_emb"]
        assert isinstance(rotary, list) and len(rotary) == 2 and all(t.device.type == "cpu" for t in rotary)
        if role == "draft":
            assert "model.fc" in first
            assert not any(name.startswith("model.layers.1.") for name in first)
        else:
            assert f"model.layers.{layers - 1}.mlp.down_proj" in first and "model.fc" not in first


def test_decode_bench_micro_preset(tmp_path):
    """Issue 11's shape: the target alone, one token per step, one thread; CPU per tensor reported
    against the no-op wrapper's, and the dump holds every step."""
    out, result_json = tmp_path / "dumps", tmp_path / "micro.json"
    stdout = run_script("decode_bench.py", "--preset", "micro", "--rounds", "6", "--reps", "1", "--modes",
                        "none,noop-wrapper,fastdump-process", "--out", str(out), "--keep-dumps",
                        "--json", str(result_json))
    result = json.loads(result_json.read_text())
    assert result["config"]["loop"] == "decode" and result["config"]["torch_threads"] == 1
    assert result["expected_passes"] == {"target": 7}
    calls = result["config"]["module_calls_per_pass"]["target"]
    assert calls == len(decode_bench.leaf_modules(build_models(PRESETS["micro"].model, with_draft=False)[0]))
    assert "CPU/tensor" in stdout and "vs noop" in stdout
    noop = result["modes"][decode_bench.NOOP]["roles"]["target"]
    assert noop["tensors_per_step"] == calls and noop["thread_cpu_per_tensor_s"] is not None
    if not check_mode_status(result["modes"], "fastdump-process", True):
        return
    entry = result["modes"]["fastdump-process"]
    assert entry["bit_exact_vs_none"] and set(entry["roles"]) == {"target"}
    role = entry["roles"]["target"]
    assert role["passes_last_rep"] == 7 and role["tensors_per_step"] > calls  # tuple outputs: several
    # (vs noop is None when noise makes the no-op wrapper's few-step figure <= 0)
    assert role["thread_cpu_per_tensor_s"] is not None and "cpu_per_tensor_vs_noop" in role
    with FASTDUMP.open(out / "fastdump-process" / "rep0") as dumps:
        assert dumps.roles == ["target"] and len(dumps.passes("target")) == 7
        assert dumps.meta("target", None, 1).get("forward_mode") == "decode"


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_decode_bench_fastdump_dumps_readable(decode_run):
    _stdout, result, out, flag_dir = decode_run
    last_rep = result["config"]["reps"] - 1
    for root in (out / "fastdump-process" / f"rep{last_rep}", flag_dir / f"rep{last_rep}"):
        with FASTDUMP.open(root) as dumps:
            assert dumps.roles == ["draft", "target"]
            for role in ("draft", "target"):
                assert len(dumps.passes(role)) == result["expected_passes"][role], (root, role)
            assert dumps.meta("target", None, 1).get("forward_mode") == "verify"
            assert dumps.meta("draft", None, 1).get("forward_mode") == "draft"


# ------------------------------------------------------------------------------------------------
# writer_bench and hook_bench
# ------------------------------------------------------------------------------------------------


def test_writer_bench_tiny(tmp_path):
    stdout = run_script("writer_bench.py", "--tiny", "--out", str(tmp_path / "dumps"), "--json",
                        str(tmp_path / "writer.json"))
    result = json.loads((tmp_path / "writer.json").read_text())
    assert set(result["modes"]) == set(writer_bench.MODES)
    assert "8 KiB tensors/s" in stdout and "| raw " in stdout
    assert result["modes"]["raw"]["large"]["bytes_per_s"] > 0
    for mode in ("fastdump-process", "fastdump-thread", "naive-h5"):
        if not check_mode_status(result["modes"], mode, mode.startswith("fastdump")):
            continue
        entry = result["modes"][mode]
        assert entry["small"]["tensors_per_s"] > 0 and entry["large"]["bytes_per_s"] > 0
        assert entry["small"]["dropped"] == 0  # policy block
        assert "error" not in entry, entry


def test_hook_bench_tiny(tmp_path):
    stdout = run_script("hook_bench.py", "--tiny", "--out", str(tmp_path / "dumps"), "--json",
                        str(tmp_path / "hook.json"))
    result = json.loads((tmp_path / "hook.json").read_text())
    assert set(result["modes"]) == set(hook_bench.MODES)
    assert "added µs/module" in stdout
    for mode in hook_bench.MODES:
        if check_mode_status(result["modes"], mode, mode == "fastdump") and mode != "none":
            assert result["modes"][mode]["added_us_per_module"] is not None


# ------------------------------------------------------------------------------------------------
# The benchmark model and loop themselves (in process, fp64 so argmax never sits on a rounding tie)
# ------------------------------------------------------------------------------------------------


def small_vocab_config() -> ModelConfig:
    # vocab 4: random draft and target agree often, so acceptance > 0 and rollback is exercised.
    return ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                       vocab_size=4, max_seq_len=128)


def test_speculative_decode_equals_greedy_decode():
    target, draft = build_models(small_vocab_config(), dtype=torch.float64, seed=3)
    allocate_kv_caches([target, draft], batch_size=1)
    prompt = torch.randint(0, 4, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        run = decode_bench.speculative_decode(target, draft, prompt, rounds=12, k=3)
        reference = decode_bench.greedy_decode(target, prompt, run.tokens.shape[1] - prompt.shape[1])
    assert sum(run.accepted) > 0, "no draft accepted: the rollback path was not exercised"
    assert torch.equal(run.tokens, reference)


def test_draft_shares_embedding_and_head_and_fused_norm_is_in_place():
    target, draft = build_models(PRESETS["tiny"].model, seed=0)
    assert draft.model.embed_tokens is target.model.embed_tokens and draft.lm_head is target.lm_head
    names = dict(draft.named_modules())
    assert {"model.embed_tokens", "model.fc", "model.layers.0.self_attn.q_proj", "model.norm", "lm_head"} <= set(names)
    allocate_kv_caches([target, draft], batch_size=1)
    seen = {}
    o_proj = target.model.layers[0].self_attn.o_proj
    o_proj.register_forward_hook(lambda _m, _i, out: seen.update(ref=out, copy=out.clone()))
    with torch.inference_mode():
        target(torch.tensor([[1, 2, 3]]))
    # The fused add+RMSNorm overwrote o_proj's output after its hook: dumpers must copy in the hook.
    assert not torch.equal(seen["ref"], seen["copy"])


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_fastdump_dump_matches_logits_of_both_roles(tmp_path):
    """What fastdump wrote for the shared LM head equals the logits each role computed."""
    target, draft = build_models(PRESETS["tiny"].model, seed=0)
    allocate_kv_caches([target, draft], batch_size=2)
    prompt = torch.randint(0, PRESETS["tiny"].model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    session = decode_bench.FastdumpSession(FASTDUMP, decode_bench.FASTDUMP_MODES["fastdump-process"], ring_mb=64)
    session.attach({"target": target, "draft": draft}, tmp_path)
    try:
        with torch.inference_mode():
            run = decode_bench.speculative_decode(target, draft, prompt, rounds=2, k=2, on_pass=session.on_pass)
    finally:
        session.close()
    logits_by_role = {"target": [], "draft": []}
    for (role, _mode, _seconds), logits in zip(run.pass_times, run.logits):
        logits_by_role[role].append(logits)
    with FASTDUMP.open(tmp_path) as dumps:
        for role, expected in logits_by_role.items():
            assert dumps.passes(role) == list(range(len(expected)))
            for pass_id, logits in enumerate(expected):
                assert torch.equal(dumps.tensor(role, None, "lm_head", pass_id), logits), (role, pass_id)


def test_sglang_style_on_cpu_keeps_references_unless_cloning(tmp_path):
    """Faithful SGLang on CPU saves aliases (``.cpu()`` is a no-op), so the fused in-place norm
    changes what it saved; the ``copy_on_cpu`` variant saves the values the hooks saw."""
    from benchmarks.baselines import SGLangStyleDumper

    target, _ = build_models(PRESETS["tiny"].model, seed=0, with_draft=False)
    allocate_kv_caches([target], batch_size=1)
    at_hook_time = {}

    def remember_first_output(_module, _inputs, output):  # returns None: must not replace the output
        at_hook_time.setdefault("o_proj", output.clone())

    target.model.layers[0].self_attn.o_proj.register_forward_hook(remember_first_output)
    saved = {}
    for copy_on_cpu in (False, True):
        dumper = SGLangStyleDumper(target, tmp_path / str(copy_on_cpu), role="target", copy_on_cpu=copy_on_cpu)
        target.kv_cache.reset()
        with torch.inference_mode():
            target(torch.tensor([[1, 2, 3]]))
            target(torch.tensor([[4]]))  # the first pass file is written when the second one ends
        dumper.close()
        (pass_file,) = (tmp_path / str(copy_on_cpu) / "target").glob("*/Pass00000.pt")
        saved[copy_on_cpu] = torch.load(pass_file, weights_only=True)["model.layers.0.self_attn.o_proj"]
    assert not torch.equal(saved[False], at_hook_time["o_proj"])
    assert torch.equal(saved[True], at_hook_time["o_proj"])


def test_failed_attach_leaves_no_hooks_behind(tmp_path):
    """A mode that fails half-way (draft attach) must not leave the target's hooks on the shared
    modules, or every later mode would be measured with them."""
    from benchmarks.baselines import SGLangStyleDumper

    target, draft = build_models(PRESETS["tiny"].model, seed=0)
    allocate_kv_caches([target, draft], batch_size=1)

    def dumper_failing_for_draft(model, root, role):
        if role == "draft":
            raise RuntimeError("simulated attach failure")
        return SGLangStyleDumper(model, root, role=role)

    session = decode_bench.BaselineSession(dumper_failing_for_draft)
    args = decode_bench.parse_args(["--tiny"])
    result = decode_bench.ModeResult()
    with pytest.raises(RuntimeError, match="simulated"):
        decode_bench.run_one(session, {"target": target, "draft": draft}, torch.zeros(1, 4, dtype=torch.long),
                             args, lambda: None, tmp_path, result)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in target.modules())


# ------------------------------------------------------------------------------------------------
# hf_decode_bench
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_hf_decode_bench_runs_and_dumps_bit_exact(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    result_json = tmp_path / "hf.json"
    stdout = run_script("hf_decode_bench.py", "--layers", "2", "--hidden", "64", "--steps", "3", "--reps", "1",
                        "--json", str(result_json))
    assert "fastdump CPU per tensor" in stdout
    result = json.loads(result_json.read_text())
    assert set(result["modes"]) == {"none", "noop-wrapper", "fastdump"}
    # the leaves of a 2-layer Llama: 2 x (4 attention projections + 3 MLP + act + 2 norms) + embed, norm,
    # lm_head, and rotary_emb's (cos, sin); plus the root's CausalLMOutput logits (its cache is skipped)
    assert result["bit_exact_tensors"] == 2 * 10 + 3 + 2  # the read-back check compares every leaf output
    assert result["tensors_per_step"] == 2 * 10 + 3 + 2 + 1
    assert result["modes"]["fastdump"]["dropped"] == 0


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_writer_interference_bench_runs_all_three_modes():
    stdout = run_script("writer_interference_bench.py", "--preset", "tiny", "--steps", "5", "--reps", "1")
    for mode in ("none", "running", "stopped"):
        assert f"\n{mode}" in "\n" + stdout, stdout
    assert "dumped tensors/step" in stdout
    assert "writer CPU/tensor" in stdout  # the running writer's own CPU, from /proc


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_paired_step_bench_dumps_every_other_step_whole(tmp_path):
    result_json = tmp_path / "paired.json"
    stdout = run_script("paired_step_bench.py", "--model", "micro", "--steps", "20", "--reps", "2",
                        "--json", str(result_json))
    assert "dumped / undumped" in stdout
    result = json.loads(result_json.read_text())
    # every dumped step is a whole pass of the micro model; the script exits non-zero on drops, a bad
    # close, or dumped and undumped steps that do not alternate
    assert result["tensors_per_dumped_step"] == 95
    # Ratios only sane, not measured: 20 steps on a shared machine (3.16 once, under 4 other jobs).
    for key in ("dumped_vs_undumped", "undumped_vs_none", "dumped_vs_none"):
        assert 0.5 < result[key] < 8.0, (key, result[key])


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_pass_bench_times_the_root_wrapper_of_whole_passes(tmp_path):
    result_json = tmp_path / "pass.json"
    stdout = run_script("pass_bench.py", "--steps", "20", "--rounds", "1", "--json", str(result_json))
    assert "root wrapper" in stdout and "C / Python per pass" in stdout
    result = json.loads(result_json.read_text())
    # the script exits non-zero unless every step was a whole dumped pass, nothing dropped
    assert result["tensors_per_pass"] == 95 and result["steps"] == 20
    assert 0 < result["begin_per_pass_s"] < result["python_per_pass_s"] < 0.05
    assert 0 < result["c_per_pass_s"] < 0.05 and result["runs"]["c"][0]["begin_per_pass_s"] is None


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_leaf_bench_times_whole_dumped_passes_against_undumped_ones(tmp_path):
    result_json = tmp_path / "leaf.json"
    stdout = run_script("leaf_bench.py", "--leaves", "10", "--groups", "12", "--pollute-kib", "4",
                        "--json", str(result_json))
    assert "per dumped tensor" in stdout
    result = json.loads(result_json.read_text())
    # the script exits non-zero unless every dumped pass staged every leaf and the root, none dropped
    assert result["tensors_per_dumped_pass"] == 11 and result["groups"] == 12
    assert result["tensors"] == 11 * result["passes"] and result["passes"] >= 12
    assert 0 < result["per_tensor_us"] < 1000


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_paired_step_bench_vs_noop_interleaves_four_kinds_of_step(tmp_path):
    result_json = tmp_path / "vs_noop.json"
    stdout = run_script("paired_step_bench.py", "--model", "micro", "--vs-noop", "--steps", "40", "--reps", "2",
                        "--json", str(result_json))
    assert "per dumped tensor" in stdout and "no-op wrapper per call" in stdout
    result = json.loads(result_json.read_text())
    # 95 tensors per dumped pass (every leaf and the root's output), 75 leaf modules each called once
    assert result["tensors_per_dumped_step"] == 95
    assert result["wrapped_calls"] == 75
    # each group of four steps held one dumped, one undumped, one bare and one noop step
    assert result["groups"] == 2 * 10
    assert all(rep["groups"] == 10 for rep in result["reps"])


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_lane_bench_against_the_mock_runtime(tmp_path):
    # gpu_check.sh --dry-run runs this; on a GPU the same script measures the real lean path
    result_json = tmp_path / "lane.json"
    stdout = run_script("lane_bench.py", "--mock", "--tensors", "70", "--passes", "2", "--json", str(result_json))
    result = json.loads(result_json.read_text())
    if result["status"] == "skipped":
        pytest.skip(f"the mock CUDA runtime could not be built here: {stdout.strip()[-200:]}")
    assert result["status"] == "ok"
    lean, checked = result["lean"], result["checked"]
    assert lean["lean_tensors"] == 2 * 70  # every tensor took the lean path
    assert checked["events_per_pass"] == 70.0  # the checked path records an event per tensor
    assert lean["events_per_pass"] == 2.0  # the lean one: one per 64 snapshots, and one at the pass end
    assert set(result["python_calls"]) == {"get_device_us", "raw_stream_us", "record_stream_us"}
    assert "Python-level calls per CUDA tensor" in stdout


# ------------------------------------------------------------------------------------------------
# gpu_check.sh (the one call on a GPU machine) in its dry-run form
# ------------------------------------------------------------------------------------------------


def run_gpu_check(out: Path, env_extra: dict | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTDUMP_", "GPU_CHECK_", "STAGES"))}
    env.update(env_extra or {})
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"gpu_check.sh failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_gpu_check_dry_run_leaves_three_files_and_a_table(tmp_path):
    # The GPU machine's tool returns at most 8 files and the last 12,000 characters of output.
    out = tmp_path / "out"
    stdout = run_gpu_check(out)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.tar.gz", "summary.json"]
    assert len(stdout) < 12000
    summary = json.loads((out / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == ["deps", "build", "decode-bench", "decode-graphs", "pytest-cuda", "lane-bench",
                            "d2h-bench", "d2h-decode"]
    for name, stage in stages.items():
        assert stage["status"] == "ok", (name, stage)
        assert f"| {name} " in stdout
    assert "fastdump-process:" in stages["decode-bench"]["result"]
    assert summary["results"]["decode"]["partial"] is False
    import tarfile

    with tarfile.open(out / "results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"stages.tsv", "pytest-cuda.xml", "decode.json", "graphs.json", "d2h.json", "d2h-decode.json",
            "lane.json"} <= names


def test_gpu_check_timed_out_stage_prints_its_tail(tmp_path):
    out = tmp_path / "out"
    stdout = run_gpu_check(out, {"STAGES": "decode-bench", "GPU_CHECK_MAX_S": "decode-bench=1"})
    assert "=== decode-bench: timeout after 1s" in stdout
    assert "--- last 40 lines of decode-bench's output:" in stdout
    stage = json.loads((out / "summary.json").read_text())["stages"]["decode-bench"]
    assert stage["status"] == "timeout after 1s" and stage["rc"] == "124"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.tar.gz", "summary.json"]


def _gpu_check_here(out: Path, env_extra: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """gpu_check.sh OUTDIR without --dry-run, on this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTDUMP_", "GPU_CHECK_", "STAGES"))}
    env.update(PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_without_a_gpu_says_so_and_skips_the_gpu_stages(tmp_path):
    """Run without --dry-run where there is no GPU: the benchmarks fell back to their CPU or dry-run
    forms and every cuda test skipped, and the table said "ok" for them (6 of 7 stages ok, no GPU
    anywhere). Now the script asks torch first, says why on stdout, marks every stage but deps
    skipped, still leaves its table and files, and exits 3."""
    out = tmp_path / "out"
    proc = _gpu_check_here(out, {"STAGES": "deps,decode-graphs,lane-bench"}, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no usable GPU: torch " in proc.stdout and "sees no usable CUDA device" in proc.stdout
    stages = json.loads((out / "summary.json").read_text())["stages"]
    assert {k: v["status"] for k, v in stages.items()} == {
        "deps": "ok", "decode-graphs": "skipped (no GPU)", "lane-bench": "skipped (no GPU)"}
    assert "| decode-graphs | skipped (no GPU) |" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.tar.gz", "summary.json"]


_GPU_PYTHON = r"""#!/usr/bin/env bash
# Python on a machine that says it has a GPU (the probe) and a fastdump._C with CUDA (no build stage).
if [[ "$1" == -c && ( "$2" == *torch.cuda.is_available* || "$2" == *cuda_compiled* ) ]]; then
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: its cuda tests run")
def test_gpu_check_pytest_cuda_fails_when_every_cuda_test_skipped(tmp_path):
    """On a GPU machine whose cuda tests all skip (fastdump._C without CUDA, a GPU torch cannot
    use), pytest-cuda said "ok" with every test skipped: a GPU run that tested nothing read as
    passed. Now the stage fails and says why."""
    fake = tmp_path / "python"
    fake.write_text(_GPU_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = _gpu_check_here(out, {"STAGES": "pytest-cuda", "PYTHON": str(fake), "REAL_PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stage = json.loads((out / "summary.json").read_text())["stages"]["pytest-cuda"]
    assert stage["status"] == "FAILED (rc 1)", stage
    assert "pytest-cuda: every one of the" in proc.stdout and "cuda tests skipped" in proc.stdout


_FAKE_PYTHON = r"""#!/usr/bin/env bash
# A Python without pytest: `import pytest` works once pip installed pytest AND its dependency pluggy;
# `-m pip install` installs what it names, and pluggy with pytest unless --no-deps (as pip does).
state=$FAKE_STATE
if [[ "$1" == -c && "$2" =~ ^import\ (pytest|torch)$ ]]; then
  [[ ${BASH_REMATCH[1]} == pytest && -e $state/pytest && -e $state/pluggy ]]
  exit
fi
if [[ "$1" == -m && "$2" == pip ]]; then
  echo "$*" >>"$state/pip_calls"
  deps=1
  for a in "$@"; do [[ $a == --no-deps ]] && deps=0; done
  for a in "${@:3}"; do
    [[ $a == -* || $a == install || $a == .whl ]] && continue
    touch "$state/$a"
    [[ $a == pytest && $deps == 1 ]] && touch "$state/pluggy"
  done
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def test_gpu_check_deps_installs_carried_wheels_with_their_dependencies(tmp_path):
    """The GPU machine is offline: a missing package comes from wheels carried in .whl/. It was
    installed with --no-deps, so pytest came without pluggy and still did not import, and the stage
    said ok anyway. Now its dependencies come from .whl/ too, and the stage is ok only if every
    module imports afterwards (torch, which no wheel brings, fails it)."""
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    for f in ("gpu_check.sh", "gpu_check_summary.py"):
        shutil.copy(REPO / "benchmarks" / f, tree / "benchmarks" / f)
    (tree / ".whl").mkdir()
    (tree / ".whl" / "pytest-9.0.0-py3-none-any.whl").write_bytes(b"")
    state = tmp_path / "state"
    state.mkdir()
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTDUMP_", "GPU_CHECK_", "STAGES"))}
    env.update(PYTHON=str(fake), FAKE_STATE=str(state), REAL_PYTHON=sys.executable, STAGES="deps",
               PYTHONPATH=str(REPO))

    def deps_stage(out):
        proc = subprocess.run(["bash", str(tree / "benchmarks" / "gpu_check.sh"), str(out)], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads((out / "summary.json").read_text())["stages"]["deps"], (out / "gpu_check.log").read_text()

    stage, log = deps_stage(tmp_path / "out1")
    assert "--no-deps" not in (state / "pip_calls").read_text()
    assert (state / "pytest").exists() and (state / "pluggy").exists()  # pytest imports now
    # torch is still missing (no wheel brings it): the stage fails and says so
    assert stage["status"] == "FAILED (rc 1)", stage
    assert "still missing: torch" in log and "pytest" not in log.split("still missing:")[1].splitlines()[0]


def test_gpu_check_summary_reads_partial_results(tmp_path):
    """A benchmark killed by its stage timeout leaves the JSON of its finished pieces: shown as partial;
    a graph role whose check replays were all dropped reads 'unchecked', never 'NOT bit-exact'."""
    from benchmarks import gpu_check_summary

    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    log = b"=== decode-bench\nsome output\n=== decode-graphs\nmore\n"
    (out / "gpu_check.log").write_bytes(log)
    (work / "stages.tsv").write_text("decode-bench\ttimeout after 150s\t160\t124\t150\t0\t28\n"
                                     "decode-graphs\tok\t40\t0\t75\t28\t50\n")
    role = {"status": "ok", "ratio": 1.02, "replay_s_plain": 0.004, "tensors_per_pass": 387, "dropped_timed": 3,
            "timed_dumped_replays": 200, "bit_exact": None, "checked_replays": 0}
    (work / "graphs.json").write_text(json.dumps({"status": "ok", "partial": False, "roles": {"target": role}}))
    (work / "decode.json").write_text(json.dumps({
        "partial": True, "config": {"reps": 3}, "runs_done": {"none": 2, "fastdump-process": 1},
        "modes": {"none": {"status": "ok", "roles": {}},
                  "fastdump-process": {"status": "ok", "bit_exact_vs_none": True,
                                       "roles": {"target": {"ratio_to_none": 1.05}}},
                  "sglang-style": {"status": "pending"}}}))
    assert gpu_check_summary.main([str(out), str(work), "470", "0"]) == 0
    stages = json.loads((out / "summary.json").read_text())["stages"]
    decode, graphs = stages["decode-bench"]["result"], stages["decode-graphs"]["result"]
    assert decode.startswith("partial (runs of 3: none 2, fastdump-process 1")
    assert "fastdump-process: target 1.050x" in decode and "sglang-style: pending" in decode
    assert "unchecked" in graphs and "NOT bit-exact" not in graphs and "dropped 3/200 timed" in graphs


def test_readme_demo_dumps_both_roles_and_verifies(tmp_path):
    """The README's first command ends in examples/demo.py: an EAGLE-style target and draft decode
    with both roles dumped, the target's prefill logits checked bit for bit, then ls and verify."""
    import fastdump

    root = tmp_path / "demo"
    done = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py"), str(root)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "lm_head equals the model's logits: True" in done.stdout
    assert done.stdout.rstrip().endswith("OK"), done.stdout[-2000:]
    ds = fastdump.open(root)
    assert ds.roles == ["draft", "target"]
    assert all(ds.rank_info(role, 0)["status"] == "closed" and ds.passes(role, 0) for role in ds.roles)



@pytest.mark.skipif(not FASTDUMP_AVAILABLE, reason="fastdump is not importable")
def test_read_bench_times_every_read_command(tmp_path):
    """read_bench makes a pair of dumps, runs each read command on them as a user would (one that
    fails stops it) and prints one row per dump, command and checkout. (The wide pair only: each
    command is a process importing torch; the micro pair's dumps come from the micro preset, which
    test_decode_bench_micro_preset runs.)"""
    stdout = run_script("read_bench.py", "--kinds", "wide", "--leaves", "30", "--rounds", "1", "--dir", str(tmp_path))
    rows = [line.split() for line in stdout.splitlines() if line.startswith("wide ")]
    assert [" ".join(row[1:-5]) for row in rows] == ["verify", "verify --data", "ls", "show", "diff --html", "export"]
    assert all(row[-5] == "this" and row[-1] == "0" for row in rows)
    assert (tmp_path / "wide-A").is_dir() and (tmp_path / "wide-B").is_dir() and not (tmp_path / "micro-A").exists()
