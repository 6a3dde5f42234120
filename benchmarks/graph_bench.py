"""Graph-mode decode: CUDA-graph replay time with fastdump's record mode vs without.

Run through ``decode_bench.py --cuda-graphs`` (same preset options). Per role (the target decode
step and the EAGLE draft step), as SGLang's / vLLM's graph runners do: static input buffers, warm-up
forwards on a side stream, ``torch.cuda.graph`` capture (global mode), then ``CUDAGraph.replay()``.
Two graphs per role: one captured with no Dumper, one captured with a Dumper attached
(``cuda_graphs="record"``: every leaf module output recorded into the graph). Replays of the two are
timed alternately with CUDA events (blocks of replays, median over blocks); the ratio is the cost
of dumping per replay (target: <= 1.05). Replays the recorder had no ring space for are dropped
(counted, not copied): the ones dropped during the timed blocks are reported beside the ratio,
since a dropped replay skips its copies and so looks cheaper. Then, once the recorder has drained,
a few replays with fresh inputs are checked bit for bit: the dumped root output of each replay pass
must equal the graph's output after that replay. If every check replay was dropped anyway, the
role reports "unchecked" (bit_exact None), not a mismatch.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import import_fastdump, remove_tree
from benchmarks.models import allocate_kv_caches, build_models


def _step(role, model, ids, features):
    """One decode step at a fixed cache length (a graph bakes the length in, as a static shape)."""
    model.kv_cache.length = model.graph_length
    if role == "target":
        return model(ids, last_only=True)
    return model(ids, features, last_only=True)


def _capture(role, model, ids, features, stream):
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up, as the graph runners do (also passes of an attached Dumper)
            _step(role, model, ids, features)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = _step(role, model, ids, features)
    return graph, out


def _time_replays(graph, stream, block: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(block):
            graph.replay()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / block


def run_role(role, model, fastdump, args, root: Path, hidden: int, vocab: int) -> dict:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(args.seed + 7)
    ids = torch.randint(0, vocab, (args.batch, 1), device=device, generator=gen)
    features = torch.randn((args.batch, 1, hidden), device=device, dtype=next(model.parameters()).dtype,
                           generator=gen)
    model.graph_length = args.prompt_len
    for t in model.kv_cache.keys + model.kv_cache.values:  # never time on zeros
        t.normal_(generator=gen)
    stream = torch.cuda.Stream()
    with torch.inference_mode():
        plain, _ = _capture(role, model, ids, features, stream)
        dumper = fastdump.attach(model, str(root), role=role, tp_rank=0, tp_size=1, device=device,
                                 cuda_graphs="record")
        try:
            dumped, out = _capture(role, model, ids, features, stream)
            recorder = dumper._graphs.recorder(device.index if device.index is not None
                                               else torch.cuda.current_device())
            if recorder is None:
                raise RuntimeError(f"no CUDA-graph recorder: {dumper._graphs._failures}")
            for g in (plain, dumped):  # untimed first replays
                with torch.cuda.stream(stream):
                    g.replay()
            stream.synchronize()
            dropped_before = recorder.dropped_replays
            t_plain, t_dump = [], []
            for _ in range(args.graph_blocks):
                t_plain.append(_time_replays(plain, stream, args.graph_block))
                t_dump.append(_time_replays(dumped, stream, args.graph_block))
            timed_replays = 1 + args.graph_blocks * args.graph_block
            # Let the recorder drain the timed replays first: with its ring still full, the check
            # replays below would be dropped and nothing could be compared.
            stream.synchronize()
            drained = recorder.flush(60)
            dropped_timed = recorder.dropped_replays - dropped_before
            # Bit-exactness: fresh inputs, one replay each, the graph's own output kept.
            logits_out = out[0]
            want = []
            for k in range(args.graph_checks):
                with torch.cuda.stream(stream):  # the new inputs on the replay's stream: ordered after the last replay
                    ids.copy_(torch.randint(0, vocab, ids.shape, device=device, generator=gen))
                    features.normal_(generator=gen)
                    dumped.replay()
                    want.append(logits_out.clone())
            stream.synchronize()
            close_t0 = time.perf_counter()
            stats = dumper.close()
            close_s = time.perf_counter() - close_t0
        finally:
            dumper.close()
    ds = fastdump.open(str(root))
    graph_passes = [p for p in ds.passes(role, 0) if p >= (1 << 40)]
    by_replay = {ds.meta(role, 0, p)["graph_replay"]: p for p in graph_passes[-2 * args.graph_checks:]}
    root_name = type(model).__name__
    dropped = stats.get("dropped_passes", 0)
    accounted = len(graph_passes) + dropped == timed_replays + args.graph_checks
    exact, checked = True, 0  # checked == 0: every check replay was dropped, so nothing was compared
    for k, w in enumerate(want):
        p = by_replay.get(timed_replays + k)
        if p is None:  # dropped (counted): nothing to compare
            continue
        got = ds.load(role, 0, p)
        value = torch.as_tensor(got.get(f"{root_name}.0", got.get(root_name)))
        exact = exact and value.shape == w.shape and bool(
            value.contiguous().view(torch.uint8).equal(w.cpu().contiguous().view(torch.uint8)))
        checked += 1
    tensors_per_pass = ds.meta(role, 0, graph_passes[0])["tensors"] if graph_passes else 0
    plain_s, dump_s = statistics.median(t_plain), statistics.median(t_dump)
    return {"status": "ok", "replay_s_plain": plain_s, "replay_s_dump": dump_s, "ratio": dump_s / plain_s,
            "timed_dumped_replays": args.graph_blocks * args.graph_block, "dropped_timed": dropped_timed,
            "drained_before_checks": drained,
            "replays": timed_replays + args.graph_checks, "graph_passes": len(graph_passes),
            "dropped_passes": dropped, "accounted": accounted, "tensors_per_pass": tensors_per_pass,
            "bit_exact": (exact if checked else None), "check": check_verdict(exact, checked, args.graph_checks),
            "checked_replays": checked, "close_s": close_s}


def check_verdict(exact: bool, checked: int, wanted: int) -> str:
    if checked == 0:
        return f"unchecked (all {wanted} check replays dropped)"
    return "bit-exact" if exact else "NOT bit-exact"


def main(args, save=lambda payload: None) -> dict:
    """``save(payload)`` is called after each role, with payload["partial"] True until the end."""
    payload = {"benchmark": "decode-graphs", "config": {"preset": args.preset, "batch": args.batch,
                                                         "prompt_len": args.prompt_len}, "roles": {},
               "partial": True}
    if args.device.type != "cuda" or not torch.cuda.is_available():
        payload["status"], payload["partial"] = "unavailable: CUDA graphs need a CUDA device", False
        print(payload["status"])
        return payload
    fastdump, reason = import_fastdump()
    if fastdump is None:
        payload["status"], payload["partial"] = f"unavailable: {reason}", False
        return payload
    payload["status"] = "running"
    save(payload)
    config = args.preset_config.model
    target, draft = build_models(config, device=args.device, dtype=args.dtype, seed=args.seed)
    allocate_kv_caches([target, draft], args.batch, args.prompt_len + 8)
    out_root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fastdump-graphs-"))
    for role, model in (("target", target), ("draft", draft)):
        try:
            payload["roles"][role] = run_role(role, model, fastdump, args, out_root / role, config.hidden_size,
                                              config.vocab_size)
        except Exception as exc:
            traceback.print_exc()
            payload["roles"][role] = {"status": f"error: {type(exc).__name__}: {exc}"}
        save(payload)
    if not args.keep_dumps:
        remove_tree(out_root)
    payload["status"], payload["partial"] = "ok", False
    print(f"graph replay, preset {args.preset}, batch {args.batch} (dumped / plain; target <= 1.05x):")
    for role, r in payload["roles"].items():
        if r.get("status") != "ok":
            print(f"  {role:6s} {r.get('status')}")
            continue
        print(f"  {role:6s} {r['replay_s_plain'] * 1e3:8.3f} ms -> {r['replay_s_dump'] * 1e3:8.3f} ms  "
              f"{r['ratio']:.3f}x (dropped {r['dropped_timed']}/{r['timed_dumped_replays']} timed)  "
              f"{r['tensors_per_pass']} tensors/pass  passes {r['graph_passes']}/{r['replays']}  "
              f"dropped {r['dropped_passes']}  {r['check']} ({r['checked_replays']} checked)")
    return payload
