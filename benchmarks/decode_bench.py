"""Speculative (EAGLE-style) decoding with every leaf module dumped: step-time cost of each dumper.

One run measures all modes side by side, round-robin per repetition, and reports medians:
  none              no dump
  fastdump-process  fastdump.attach(..., writer="process", policy="block")
  fastdump-thread   fastdump.attach(..., writer="thread",  policy="block")
  fastdump-drop     fastdump.attach(..., writer="process", policy="drop")
  sglang-style      SGLang's synchronous hook dumper (benchmarks/baselines.py)
  sglang-style-clone  (opt-in) the same with a real copy on CPU (.cpu() is a no-op there)
  naive-h5          snapshot + queue + h5py dataset per tensor in a thread (baselines.py)
  flag              only when FASTDUMP_DIR is set: fastdump.maybe_attach(model, role=...)
  noop-wrapper      the reference for per-tensor cost: every leaf module's forward wrapped (as
                    fastdump wraps it) by a function that only calls the original

Besides step times, each forward's thread CPU time (time.thread_time()) is measured: "CPU/tensor"
is (thread CPU per step - none's) / tensors dumped per step (module calls per step for the
baselines and noop-wrapper), and "vs noop" divides it by noop-wrapper's.

The `micro` preset runs a plain decode loop instead (the target alone, one token per step, one
torch thread: issue 11's shape). The speculative loop, per round: k draft decode passes (draft model, one token each), one target verify pass
over [last token, k drafts], greedy acceptance, KV rollback (reset the cache length), and a
draft extend pass over the accepted tokens. Dumps are closed (flushed) outside the timed region;
the time that takes is reported as "close".

    python benchmarks/decode_bench.py --tiny
    python benchmarks/decode_bench.py --preset small --json results/decode-small.json
    python benchmarks/decode_bench.py --preset micro --modes none,noop-wrapper,fastdump-process
    python benchmarks/decode_bench.py --preset 8b --device cuda --dtype bf16
    python benchmarks/decode_bench.py --preset 8b --cuda-graphs   # graph replay with record mode vs without
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.baselines import NaiveH5Dumper, SGLangStyleDumper
from benchmarks.common import (
    Stopwatch,
    default_dump_root,
    fmt_ratio,
    fmt_rate,
    fmt_seconds,
    format_table,
    import_fastdump,
    load_average,
    machine_info,
    median,
    parse_dtype,
    parse_modes,
    print_header,
    remove_tree,
    round_robin,
    stream_synchronizer,
    tensor_digest,
    write_json,
)
from benchmarks.models import PRESETS, allocate_kv_caches, build_models, preset_with_overrides

ROLES = ("draft", "target")
# The pass kind whose step time represents each role in the table.
ROLE_STEP_MODE = {"draft": "draft", "target": "verify"}
BASE_MODES = ["none", "noop-wrapper", "fastdump-process", "fastdump-thread", "fastdump-drop", "sglang-style",
              "naive-h5"]
NOOP = "noop-wrapper"  # a reference, not a dumper: it writes nothing
# Opt-in (--modes): SGLang-style with a real copy on CPU too (see baselines.py).
EXTRA_MODES = ["sglang-style-clone"]
FASTDUMP_MODES = {  # mode -> attach() keyword arguments
    "fastdump-process": {"writer": "process", "policy": "block"},
    "fastdump-thread": {"writer": "thread", "policy": "block"},
    "fastdump-drop": {"writer": "process", "policy": "drop"},
}


# --------------------------------------------------------------------------------------------
# The speculative decoding loop
# --------------------------------------------------------------------------------------------


@dataclass
class DecodeRun:
    tokens: torch.Tensor  # [batch, prompt + generated]
    prompt_len: int
    logits: list = field(default_factory=list)  # every pass's logits, in order (bit-exactness check)
    pass_times: list = field(default_factory=list)  # (role, forward_mode, seconds) per pass
    pass_cpu: list = field(default_factory=list)  # the forward thread's CPU seconds per pass
    loop_seconds: float = 0.0
    accepted: list = field(default_factory=list)  # drafts accepted per round

    @property
    def generated_tokens(self) -> int:
        return self.tokens.shape[0] * (self.tokens.shape[1] - self.prompt_len)


def speculative_decode(target, draft, prompt: torch.Tensor, rounds: int, k: int, *, sync=lambda: None,
                       on_pass=lambda role, **meta: None) -> DecodeRun:
    """Greedy EAGLE-style speculative decoding; the output equals plain greedy decoding of ``target``.

    Draft position q is fed (target feature at q, token at q+1). Batch rows accept the same number
    of drafts (the minimum over rows), which keeps every cache rectangular; rows that would have
    accepted more still get the right token (the target's own prediction).
    ``on_pass(role, forward_mode=, batch_size=, num_tokens=)`` runs before every forward
    (fastdump's pass metadata) and is timed with the step.
    """
    target.kv_cache.reset()
    draft.kv_cache.reset()
    batch_size, prompt_len = prompt.shape
    run = DecodeRun(tokens=prompt, prompt_len=prompt_len)

    forward = _timed_forward(run, sync, on_pass, batch_size)

    committed = [prompt]
    loop_start = time.perf_counter()
    sync()
    # Prefill: the target over the prompt; the draft over (target feature q, token q+1).
    logits, features = forward("target", target, "prefill", prompt, last_only=True)
    bonus = logits[:, -1].argmax(-1)  # the next token, committed, not yet in the target's cache
    committed.append(bonus[:, None])
    forward("draft", draft, "extend", prompt[:, 1:], features[:, :-1], last_only=True)
    last_feature = features[:, -1:]  # target feature at the position just before `bonus`

    for _ in range(rounds):
        start = target.kv_cache.length  # position of `bonus`
        draft_len = draft.kv_cache.length  # == start - 1
        # k draft decode passes: each proposes the next token from the previous one.
        token, feature, drafts = bonus[:, None], last_feature, []
        for _ in range(k):
            draft_logits, draft_hidden = forward("draft", draft, "draft", token, feature, last_only=True)
            token, feature = draft_logits[:, -1:].argmax(-1), draft_hidden[:, -1:]
            drafts.append(token)
        drafts = torch.cat(drafts, dim=1)  # [B, k]

        # Verify [bonus, d1..dk] in one target pass; logits j predict the token at start+j+1.
        verify_ids = torch.cat((bonus[:, None], drafts), dim=1)
        verify_logits, verify_features = forward("target", target, "verify", verify_ids)
        greedy = verify_logits.argmax(-1)  # [B, k+1]
        accepted_per_row = (drafts == greedy[:, :k]).int().cumprod(dim=1).sum(dim=1)
        accepted = int(accepted_per_row.min())
        bonus = greedy[:, accepted]
        committed += [drafts[:, :accepted], bonus[:, None]]
        run.accepted.append(accepted)

        # Roll back: the target keeps [bonus, accepted drafts]; the draft forgets its proposals
        # and extends over the accepted tokens with the target's features for them.
        target.kv_cache.length = start + accepted + 1
        draft.kv_cache.length = draft_len
        extend_features = torch.cat((last_feature, verify_features[:, :accepted]), dim=1)
        forward("draft", draft, "extend", verify_ids[:, : accepted + 1], extend_features, last_only=True)
        last_feature = verify_features[:, accepted : accepted + 1]

    sync()
    run.loop_seconds = time.perf_counter() - loop_start
    run.tokens = torch.cat(committed, dim=1)
    return run


def _timed_forward(run: DecodeRun, sync, on_pass, batch_size: int):
    """forward(role, model, forward_mode, input_ids, ...) that records its step and thread CPU time."""
    def forward(role, model, forward_mode, input_ids, *args, last_only=False):
        cpu_start = time.thread_time()
        with Stopwatch(sync) as watch:
            on_pass(role, forward_mode=forward_mode, batch_size=batch_size, num_tokens=input_ids.shape[1])
            logits, hidden = model(input_ids, *args, last_only=last_only)
        run.pass_cpu.append(time.thread_time() - cpu_start)
        run.pass_times.append((role, forward_mode, watch.seconds))
        run.logits.append(logits)
        return logits, hidden

    return forward


def plain_decode(target, prompt: torch.Tensor, steps: int, *, sync=lambda: None,
                 on_pass=lambda role, **meta: None) -> DecodeRun:
    """Greedy decoding with the target alone: a prefill, then ``steps`` passes of one token each."""
    target.kv_cache.reset()
    batch_size, prompt_len = prompt.shape
    run = DecodeRun(tokens=prompt, prompt_len=prompt_len)
    forward = _timed_forward(run, sync, on_pass, batch_size)
    loop_start = time.perf_counter()
    sync()
    logits, _ = forward("target", target, "prefill", prompt, last_only=True)
    tokens = [prompt, logits[:, -1:].argmax(-1)]
    for _ in range(steps):
        logits, _ = forward("target", target, "decode", tokens[-1], last_only=True)
        tokens.append(logits[:, -1:].argmax(-1))
    sync()
    run.loop_seconds = time.perf_counter() - loop_start
    run.tokens = torch.cat(tokens, dim=1)
    return run


def greedy_decode(target, prompt: torch.Tensor, num_new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding with the target alone (reference for the speculative loop)."""
    target.kv_cache.reset()
    logits, _ = target(prompt, last_only=True)
    tokens = [prompt, logits[:, -1:].argmax(-1)]
    for _ in range(num_new_tokens - 1):
        logits, _ = target(tokens[-1], last_only=True)
        tokens.append(logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def max_positions_needed(prompt_len: int, rounds: int, k: int) -> int:
    # (The decode loop needs prompt_len + rounds + 1: less than this with k = 0.)
    # Worst case: every draft accepted in every round, plus the k draft positions of the last round.
    return prompt_len + rounds * (k + 1) + k + 1


# --------------------------------------------------------------------------------------------
# Dump sessions: one per (mode, repetition), wrapping both roles
# --------------------------------------------------------------------------------------------


def close_all(dumpers: dict) -> dict:
    """Close every dumper (detaching it from the shared model) even if one fails; then re-raise."""
    first_error = None
    for dumper in dumpers.values():
        try:
            dumper.close()
        except Exception as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return {role: dict(dumper.stats()) for role, dumper in dumpers.items()}


class NoDump:
    def attach(self, models: dict, root: Path) -> None:
        pass

    def on_pass(self, role: str, **meta) -> None:
        pass

    def close(self) -> dict:
        return {role: {"bytes": 0, "dropped": 0} for role in ROLES}


def leaf_modules(model) -> list:
    """The modules every dumper here wraps: fastdump's default selection (every leaf)."""
    return [(name, m) for name, m in model.named_modules() if name and next(iter(m.children()), None) is None]


class NoopWrapperSession(NoDump):
    """Every leaf's forward replaced, as fastdump replaces it, by a wrapper that only calls it:
    the floor a Python per-module wrapper costs, against which fastdump's per-tensor cost is read."""

    def __init__(self):
        self._wrapped: list = []

    def attach(self, models: dict, root: Path) -> None:
        for model in models.values():
            for _name, module in leaf_modules(model):
                if "forward" not in module.__dict__:  # a module shared by both roles: wrapped once
                    module.__dict__["forward"] = self._wrapper(module.forward)
                    self._wrapped.append(module)

    @staticmethod
    def _wrapper(forward):
        @functools.wraps(forward)
        def forward_unchanged(*args, **kwargs):
            return forward(*args, **kwargs)

        return forward_unchanged

    def close(self) -> dict:
        for module in self._wrapped:
            del module.__dict__["forward"]
        self._wrapped.clear()
        return super().close()


class FastdumpSession(NoDump):
    def __init__(self, fastdump, attach_kwargs: dict | None, ring_mb: int, use_env_flag: bool = False):
        self._fastdump = fastdump
        self._attach_kwargs = attach_kwargs or {}
        self._ring_mb = ring_mb
        self._use_env_flag = use_env_flag
        self._dumpers: dict = {}

    def attach(self, models: dict, root: Path) -> None:
        for role, model in models.items():
            if self._use_env_flag:  # the profiling switch: settings come from FASTDUMP_* variables
                dumper = self._fastdump.maybe_attach(model, role=role)
                if dumper is None:
                    raise RuntimeError("maybe_attach returned None although FASTDUMP_DIR is set")
            else:
                dumper = self._fastdump.attach(model, str(root), role=role, ring_mb=self._ring_mb,
                                               **self._attach_kwargs)
            self._dumpers[role] = dumper

    def on_pass(self, role: str, **meta) -> None:
        self._dumpers[role].set_pass_meta(**meta)

    def close(self) -> dict:
        return close_all(self._dumpers)


class BaselineSession(NoDump):
    def __init__(self, dumper_class):
        self._dumper_class = dumper_class
        self._dumpers: dict = {}

    def attach(self, models: dict, root: Path) -> None:
        for role, model in models.items():
            self._dumpers[role] = self._dumper_class(model, root, role=role)

    def close(self) -> dict:
        return close_all(self._dumpers)


def _shm_free_mb() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize >> 20


def make_session(mode: str, fastdump, ring_mb: int):
    if mode == "none":
        return NoDump()
    if mode == NOOP:
        return NoopWrapperSession()
    if mode in FASTDUMP_MODES:
        return FastdumpSession(fastdump, FASTDUMP_MODES[mode], ring_mb)
    if mode == "flag":
        return FastdumpSession(fastdump, None, ring_mb, use_env_flag=True)
    if mode == "sglang-style":
        return BaselineSession(SGLangStyleDumper)
    if mode == "sglang-style-clone":
        return BaselineSession(functools.partial(SGLangStyleDumper, copy_on_cpu=True))
    if mode == "naive-h5":
        return BaselineSession(NaiveH5Dumper)
    raise ValueError(f"unknown mode {mode!r}")


# --------------------------------------------------------------------------------------------
# Measurement and report
# --------------------------------------------------------------------------------------------


@dataclass
class ModeResult:
    status: str = "ok"  # ok | unavailable | error
    reason: str | None = None
    pass_times: dict = field(default_factory=dict)  # forward_mode -> [seconds, ...] over all reps
    pass_times_by_rep: list = field(default_factory=list)  # one {forward_mode: [seconds]} per rep
    pass_cpu: dict = field(default_factory=dict)  # forward_mode -> [thread CPU seconds, ...]
    loop_seconds: list = field(default_factory=list)
    close_seconds: list = field(default_factory=list)
    role_stats: dict = field(default_factory=lambda: {role: [] for role in ROLES})  # per rep
    logits_digests: set = field(default_factory=set)
    generated_tokens: int = 0
    accepted: list = field(default_factory=list)


def run_one(session, models, prompt, args, sync, root: Path, result: ModeResult) -> None:
    try:
        session.attach(models, root)  # inside the try: a half-attached session is closed too
        with torch.inference_mode():
            if args.preset_config.loop == "decode":
                run = plain_decode(models["target"], prompt, args.rounds, sync=sync, on_pass=session.on_pass)
            else:
                run = speculative_decode(models["target"], models["draft"], prompt, args.rounds, args.k,
                                         sync=sync, on_pass=session.on_pass)
    finally:
        close_start = time.perf_counter()
        stats = session.close()  # flush and wait for the writer: outside the timed loop
        result.close_seconds.append(time.perf_counter() - close_start)
    this_rep: dict = {}
    for (role, forward_mode, seconds), cpu in zip(run.pass_times, run.pass_cpu):
        result.pass_cpu.setdefault(forward_mode, []).append(cpu)
        result.pass_times.setdefault(forward_mode, []).append(seconds)
        this_rep.setdefault(forward_mode, []).append(seconds)
    result.pass_times_by_rep.append(this_rep)
    result.loop_seconds.append(run.loop_seconds)
    for role in ROLES:
        result.role_stats[role].append(stats.get(role, {}))
    result.logits_digests.add(tensor_digest(run.logits))
    result.generated_tokens = run.generated_tokens
    result.accepted = run.accepted


def paired_ratio(result: ModeResult, none: ModeResult | None, forward_mode: str) -> float | None:
    if none is None:
        return None
    ratios = [median(mine.get(forward_mode, [])) / median(base.get(forward_mode, []))
              for mine, base in zip(result.pass_times_by_rep, none.pass_times_by_rep)
              if mine.get(forward_mode) and base.get(forward_mode)]
    return median(ratios) if ratios else None


def cpu_per_tensor(result: ModeResult, none: ModeResult | None, forward_mode: str, per_step: float | None):
    """Seconds of forward-thread CPU this mode adds per tensor (per module call), from median step CPU."""
    if none is None or not per_step or not result.pass_cpu.get(forward_mode) or not none.pass_cpu.get(forward_mode):
        return None
    return (median(result.pass_cpu[forward_mode]) - median(none.pass_cpu[forward_mode])) / per_step


def summarize(results: dict[str, ModeResult], expected_passes: dict, calls_per_pass: dict | None = None,
              step_modes: dict | None = None) -> dict:
    """``calls_per_pass``: role -> leaf module calls in one forward (the per-tensor divisor of modes
    that report no tensor count); ``step_modes``: role -> the pass kind that represents it."""
    step_modes = step_modes or ROLE_STEP_MODE
    calls_per_pass = calls_per_pass or {}
    none = results.get("none")
    reference_digest = next(iter(none.logits_digests)) if none and none.logits_digests else None
    summary = {}
    for mode, result in results.items():
        if result.status != "ok":
            summary[mode] = {"status": result.status, "reason": result.reason}
            continue
        loop_median = median(result.loop_seconds)
        roles = {}
        for role, step_mode in step_modes.items():
            times = result.pass_times.get(step_mode, [])
            none_times = none.pass_times.get(step_mode, []) if none else []
            step, none_step = median(times), median(none_times)
            per_rep = result.role_stats[role]
            bytes_per_rep = [int(s.get("bytes", 0) or 0) for s in per_rep]
            last = per_rep[-1] if per_rep else {}
            # fastdump counts what it dumped; the others are divided by the module calls per step.
            tensors_per_step = (last["tensors"] / last["passes"] if last.get("passes") and last.get("tensors")
                                else calls_per_pass.get(role))
            roles[role] = {
                "step_forward_mode": step_mode,
                "median_thread_cpu_s": median(result.pass_cpu.get(step_mode, [])),
                "tensors_per_step": tensors_per_step,
                "thread_cpu_per_tensor_s": cpu_per_tensor(result, none, step_mode, tensors_per_step),
                "median_step_s": step,
                "ratio_to_none": step / none_step if none_step == none_step and none_step > 0 else None,
                "mean_step_s": sum(times) / len(times) if times else None,
                "p90_step_s": sorted(times)[int(0.9 * (len(times) - 1))] if times else None,
                "mean_ratio_to_none": (sum(times) / len(times)) / (sum(none_times) / len(none_times))
                if times and none_times else None,
                # Background load only ever adds time: min/min is a second, contention-robust view.
                "min_step_s": min(times) if times else None,
                "min_ratio_to_none": min(times) / min(none_times) if times and none_times else None,
                # Rep by rep (each rep runs every mode once, close in time), then the median.
                "paired_ratio_to_none": paired_ratio(result, none, step_mode),
                "bytes_per_rep": bytes_per_rep,
                "bytes_per_s": median(b / s for b, s in zip(bytes_per_rep, result.loop_seconds)),
                "dropped_total": sum(int(s.get("dropped", 0) or 0) for s in per_rep),
                "passes_last_rep": per_rep[-1].get("passes") if per_rep else None,
                "expected_passes": expected_passes[role],
                "status_last_rep": per_rep[-1].get("status") if per_rep else None,
                "error_last_rep": per_rep[-1].get("error") if per_rep else None,
            }
        summary[mode] = {
            "status": "ok",
            "roles": roles,
            "median_step_s_by_forward_mode": {fm: median(t) for fm, t in result.pass_times.items()},
            "median_loop_s": loop_median,
            "loop_ratio_to_none": loop_median / median(none.loop_seconds) if none else None,
            # The loop plus the flush after it: work a short loop defers to close() (a segment that
            # rotates only at close) counts too, as it would in a long run.
            "loop_flush_ratio_to_none": median(l + c for l, c in zip(result.loop_seconds, result.close_seconds))
            / median(none.loop_seconds) if none else None,
            "generated_tokens": result.generated_tokens,
            "tokens_per_s": result.generated_tokens / loop_median,
            "median_close_s": median(result.close_seconds),
            "accepted_per_round": result.accepted,
            "logits_sha256": sorted(result.logits_digests),
            "bit_exact_vs_none": (len(result.logits_digests) == 1
                                  and next(iter(result.logits_digests)) == reference_digest),
            "reps": len(result.loop_seconds),
        }
    noop = summary.get(NOOP, {}).get("roles", {})
    for entry in summary.values():  # CPU per tensor against the no-op wrapper's per call
        for role, r in entry.get("roles", {}).items():
            floor = noop.get(role, {}).get("thread_cpu_per_tensor_s")
            mine = r["thread_cpu_per_tensor_s"]
            r["cpu_per_tensor_vs_noop"] = mine / floor if mine is not None and floor and floor > 0 else None
    return summary


def print_report(summary: dict, roles=ROLES) -> None:
    headers = ["mode", "role", "step (median)", "vs none", "vs none (min)", "loop vs none",
               "loop+flush vs none", "tokens/s",
               "dumped/s", "dropped", "CPU/tensor", "vs noop", "close (flush)", "bit-exact"]
    rows, notes = [], []
    for mode, entry in summary.items():
        if entry["status"] != "ok":
            rows.append([mode, "-", entry["status"]] + ["-"] * (len(headers) - 3))
            notes.append(f"  {mode}: {entry['reason']}")
            continue
        for role in roles:
            r = entry["roles"][role]
            first = role == roles[0]
            cpu = r["thread_cpu_per_tensor_s"]
            rows.append([
                mode if first else "",
                f"{role} ({r['step_forward_mode']})",
                fmt_seconds(r["median_step_s"]),
                fmt_ratio(r["ratio_to_none"]),
                fmt_ratio(r["min_ratio_to_none"]),
                fmt_ratio(entry["loop_ratio_to_none"]) if first else "",
                fmt_ratio(entry["loop_flush_ratio_to_none"]) if first else "",
                fmt_rate(entry["tokens_per_s"]) if first else "",
                fmt_rate(r["bytes_per_s"], "B"),
                r["dropped_total"],
                "-" if cpu is None or mode == "none" else f"{cpu * 1e6:.2f} us",
                fmt_ratio(r["cpu_per_tensor_vs_noop"]) if mode not in ("none", NOOP) else "-",
                fmt_seconds(entry["median_close_s"]) if first else "",
                ("yes" if entry["bit_exact_vs_none"] else "NO") if first else "",
            ])
            if r["error_last_rep"]:
                notes.append(f"  {mode}/{role}: status={r['status_last_rep']} error={r['error_last_rep']}")
    print(format_table(headers, rows))
    print("target (docs/DESIGN.md): fastdump step / none <= 1.10 (CPU small, and GPU 8b eager).\n"
          "'vs none (min)': fastest steps (background load only adds time); 'loop vs none': the whole\n"
          "prefill+decode loop (catches bursty costs a median hides, e.g. page-cache writeback);\n"
          "'loop+flush': the loop plus close() (work a short loop defers to its flush). Few rounds keep\n"
          "every segment open until close: use --rounds 24 or more for the steady state.\n"
          "'CPU/tensor': forward-thread CPU (time.thread_time) added per dumped tensor (per module call for\n"
          "noop-wrapper and the baselines), medians; 'vs noop': that over noop-wrapper's (target: <= 2).")
    if notes:
        print("notes:")
        print("\n".join(notes))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--tiny", action="store_true", help="same as --preset tiny (seconds on 2 CPU cores)")
    parser.add_argument("--device", help="cpu or cuda[:N] (default: the preset's)")
    parser.add_argument("--dtype", help="fp32, bf16, fp16 (default: the preset's)")
    parser.add_argument("--batch", type=int, help="batch size (default: the preset's)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default: the preset's)")
    parser.add_argument("--rounds", type=int, help="speculative rounds per run")
    parser.add_argument("--k", type=int, help="drafted tokens (draft decode passes) per round")
    parser.add_argument("--reps", type=int, help="repetitions; modes run round-robin within each")
    parser.add_argument("--modes", default=",".join(BASE_MODES),
                        help="comma-separated, from: " + ", ".join(BASE_MODES + EXTRA_MODES) + " ('none' is always run)")
    parser.add_argument("--ring-mb", type=int, help="fastdump ring size (default 256 on CPU, 2048 on CUDA)")
    parser.add_argument("--out", help="dump root (default: a fresh temp dir under /tmp)")
    parser.add_argument("--keep-dumps", action="store_true",
                        help="keep the last repetition's dumps of every mode under --out")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="graph mode instead: CUDA-graph replay time of one decode step per role, captured "
                             "with fastdump's record mode vs without (benchmarks/graph_bench.py)")
    parser.add_argument("--graph-blocks", type=int, default=10, help="--cuda-graphs: timed blocks per graph")
    parser.add_argument("--graph-block", type=int, default=20, help="--cuda-graphs: replays per timed block")
    parser.add_argument("--graph-checks", type=int, default=3, help="--cuda-graphs: replays checked bit for bit")
    args = parser.parse_args(argv)
    if args.tiny:
        args.preset = "tiny"
    preset = preset_with_overrides(args.preset, device=args.device, dtype=args.dtype, batch_size=args.batch,
                                   prompt_len=args.prompt_len, rounds=args.rounds, k=args.k, reps=args.reps)
    args.preset_config = preset
    args.device, args.dtype = torch.device(preset.device), parse_dtype(preset.dtype)
    args.batch, args.prompt_len, args.rounds, args.k, args.reps = (
        preset.batch_size, preset.prompt_len, preset.rounds, preset.k, preset.reps)
    if args.ring_mb is None:
        args.ring_mb = 2048 if args.device.type == "cuda" else 256
        free_mb = _shm_free_mb()
        if free_mb is not None and args.ring_mb > free_mb * 3 // 4:
            # A container's /dev/shm (64 MiB by default) would fail every fastdump mode at attach.
            args.ring_mb = max(16, free_mb * 3 // 4)
            print(f"decode_bench: /dev/shm has {free_mb} MiB free: ring_mb {args.ring_mb}", file=sys.stderr)
    modes = parse_modes(args.modes, BASE_MODES + EXTRA_MODES, parser.error, always_first="none")
    if os.environ.get("FASTDUMP_DIR"):
        modes.append("flag")
    args.mode_list = modes
    return args


@contextlib.contextmanager
def count_leaf_calls(models: dict):
    """Yields {role: leaf module calls per forward of that model}, filled in when the block ends."""
    calls = {role: 0 for role in models}
    forwards = {role: 0 for role in models}
    running = [None]  # the role whose forward is running (the draft shares modules with the target)

    def count_call(*_):
        if running[0] is not None:
            calls[running[0]] += 1

    def start(role):
        def hook(*_):
            running[0] = role
            forwards[role] += 1
        return hook

    handles, seen = [], set()
    for role, model in models.items():
        handles.append(model.register_forward_pre_hook(start(role)))
        for _name, module in leaf_modules(model):
            if id(module) not in seen:
                seen.add(id(module))
                handles.append(module.register_forward_hook(count_call))
    result: dict = {}
    try:
        yield result
    finally:
        for handle in handles:
            handle.remove()
        result.update({role: calls[role] / forwards[role] for role in models if forwards[role]})


def main(argv=None) -> dict:
    args = parse_args(argv)
    preset, device = args.preset_config, args.device
    threads = args.threads or preset.threads
    if threads:
        torch.set_num_threads(threads)
    if args.cuda_graphs:
        from benchmarks import graph_bench

        # graph_bench saves after each role (a killed run keeps the roles it finished)
        payload = graph_bench.main(args, save=lambda partial: write_json(args.json, partial))
        write_json(args.json, payload)
        return payload
    decode_loop = preset.loop == "decode"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset {args.preset!r} wants CUDA, which this torch/machine lacks; "
                         "use --device cpu with a smaller preset (tiny, small)")
    config = preset.model
    needed = (args.prompt_len + args.rounds + 1 if decode_loop
              else max_positions_needed(args.prompt_len, args.rounds, args.k))
    if needed > config.max_seq_len:
        raise SystemExit(f"prompt + rounds*(k+1) needs {needed} positions > max_seq_len {config.max_seq_len}")

    info = machine_info(device)
    print_header(f"decode_bench preset={args.preset} device={device} dtype={str(args.dtype).split('.')[-1]} "
                 f"batch={args.batch} prompt={args.prompt_len} rounds={args.rounds} k={args.k} reps={args.reps}",
                 info)
    target, draft = build_models(config, device=device, dtype=args.dtype, seed=args.seed,
                                 with_draft=not decode_loop)
    models = {"target": target} if decode_loop else {"target": target, "draft": draft}
    allocate_kv_caches(list(models.values()), args.batch, needed)
    step_modes = {"target": "decode"} if decode_loop else ROLE_STEP_MODE
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=generator).to(device)
    sync = stream_synchronizer(device)

    fastdump, unavailable_reason = import_fastdump()
    out_root = Path(args.out) if args.out else default_dump_root("decode")
    flag_root = os.environ.get("FASTDUMP_DIR")
    results = {mode: ModeResult() for mode in args.mode_list}
    for mode, result in results.items():
        if (mode in FASTDUMP_MODES or mode == "flag") and fastdump is None:
            result.status, result.reason = "unavailable", unavailable_reason

    # Warm-up (allocator, kernels, lazy init), untimed; it also counts each model's module calls.
    with torch.inference_mode(), count_leaf_calls(models) as calls_per_pass:
        if decode_loop:
            plain_decode(target, prompt, min(args.rounds, 2), sync=sync)
        else:
            speculative_decode(target, draft, prompt, min(args.rounds, 2), args.k, sync=sync)

    expected_passes = ({"target": 1 + args.rounds} if decode_loop
                       else {"target": 1 + args.rounds, "draft": 1 + args.rounds * (args.k + 1)})
    payload = {
        "benchmark": "decode",
        "machine": info,
        "config": {
            "preset": args.preset, "model": asdict(preset.model), "device": str(device),
            "dtype": str(args.dtype).split(".")[-1], "batch": args.batch, "prompt_len": args.prompt_len,
            "rounds": args.rounds, "k": args.k, "reps": args.reps, "ring_mb": args.ring_mb,
            "torch_threads": torch.get_num_threads(), "loop": preset.loop,
            "module_calls_per_pass": calls_per_pass,
            "modes": args.mode_list, "dump_root": str(out_root), "flag_root": flag_root,
            "command": " ".join(sys.argv),
        },
        "expected_passes": expected_passes,
    }

    def save(partial: bool) -> dict:
        """Summarize the runs done so far and write the JSON: rewritten after every (rep, mode), so a
        run killed part-way (gpu_check.sh's stage timeout) leaves its finished repetitions."""
        ran = {mode: r for mode, r in results.items() if r.status != "ok" or r.loop_seconds}
        summary = summarize(ran, expected_passes, calls_per_pass, step_modes)
        payload["modes"] = {mode: summary.get(mode, {"status": "pending", "reason": "not run yet"})
                            for mode in results}
        payload["partial"] = partial
        payload["runs_done"] = {mode: len(r.loop_seconds) for mode, r in results.items()}
        write_json(args.json, payload)
        return payload["modes"]

    save(partial=True)
    for rep in range(args.reps):
        for mode in round_robin(args.mode_list, rep):
            result = results[mode]
            if result.status != "ok":
                continue
            if mode == "flag":  # maybe_attach reads the root from the environment
                root = Path(flag_root) / f"rep{rep}"
                os.environ["FASTDUMP_DIR"] = str(root)
            else:
                root = out_root / mode / f"rep{rep}"
            try:
                run_one(make_session(mode, fastdump, args.ring_mb), models, prompt, args, sync, root, result)
            except Exception as exc:  # keep measuring the other modes; report this one as failed
                result.status = "error"
                result.reason = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            finally:
                if mode == "flag":
                    os.environ["FASTDUMP_DIR"] = flag_root
            # Keep disk use small: only the last repetition's dumps may stay (always for `flag`,
            # whose root the user chose).
            if not (rep == args.reps - 1 and (args.keep_dumps or mode == "flag")):
                remove_tree(root)
            save(partial=True)

    payload["machine"]["load_average_end"] = load_average()
    summary = save(partial=False)  # before the report: a failing print loses no result
    print_report(summary, tuple(step_modes))
    if not args.out and not args.keep_dumps:
        remove_tree(out_root)
    return payload


if __name__ == "__main__":
    main()
