"""The summary of one gpu_check.sh run: OUTDIR/summary.json and the table printed last on stdout.

    python benchmarks/gpu_check_summary.py OUTDIR WORKDIR BUDGET_S DRY_RUN

Reads WORKDIR/stages.tsv (one line per stage run: name, status, seconds, rc, limit, and the byte
range of its output in OUTDIR/gpu_check.log), the benchmarks' JSON files in WORKDIR and the log.
A benchmark killed by its stage timeout leaves the JSON it wrote after its last finished piece;
such results are shown, marked "partial". Uses only the standard library (no torch import), so
it runs in a second even when the build failed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")  # pytest -v result words
DETAIL_CHARS = 200  # per table cell on stdout (the device tool keeps only the last 12,000 characters)


def load(work: Path, name: str):
    try:
        return json.loads((work / name).read_text())
    except (OSError, ValueError):
        return None


def fmt_x(value) -> str:
    return f"{value:.3f}x" if isinstance(value, (int, float)) else "-"


def pytest_detail(text: str, junit: Path) -> tuple[str, dict]:
    info: dict = {}
    final = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", text, re.M)
    results = re.findall(r"^(tests/\S+::\S+) (" + "|".join(STATUSES) + ")", text, re.M)
    failed = [n for n, s in results if s in ("FAILED", "ERROR")]
    failed += [n for n in re.findall(r"^(?:FAILED|ERROR) (tests/\S+::\S+)", text, re.M) if n not in failed]
    info["failed"] = failed
    if junit.exists():
        m = re.search(r"<testsuite\b[^>]*>", junit.read_text(errors="replace"))
        if m:
            info["junit"] = dict(re.findall(r'(\w+)="([^"]*)"', m.group(0)))
    if final:
        detail = final[-1]
    else:  # killed: count the -v result lines; the last test line without a result is the one that hung
        counts: dict = {}
        for _name, status in results:
            counts[status.lower()] = counts.get(status.lower(), 0) + 1
        lines = re.findall(r"^(tests/\S+::\S+)(?: (\w+))?", text, re.M)
        info["killed_during"] = lines[-1][0] if lines and lines[-1][1] not in STATUSES else None
        detail = "partial: " + (", ".join(f"{v} {k}" for k, v in counts.items()) or "no test finished")
        if info["killed_during"]:
            detail += f"; killed during {info['killed_during']}"
    if failed:
        detail += "; failed: " + ", ".join(n.split("::")[-1] for n in failed[:4]) + (" ..." if len(failed) > 4 else "")
    return detail, info


def d2h_detail(d: dict) -> str:
    parts = []
    peak = (d.get("peak") or {}).get("peak_GBps")
    if peak:
        parts.append(f"peak {peak:.1f} GB/s")
    if d.get("min_ratio_to_peak") is not None:
        parts.append(f"fastdump worst {d['min_ratio_to_peak']:.0%} of peak")
    errors = [r for r in d.get("rows", []) if "error" in r]
    if errors:
        parts.append(f"{len(errors)} rows failed ({errors[0]['error'][:80]})")
    sc = d.get("stage_cost") or {}
    if "stage_us" in sc:
        parts.append(f"stage() {sc['stage_us']:.1f} us")
    rows = f"{len(d.get('rows', []))} rows"
    if d.get("status") == "partial":
        return f"partial ({rows}): " + ", ".join(parts)
    if d.get("status") == "ok":
        return ", ".join(parts)
    return f"{d.get('status')} ({rows})" + (": " + ", ".join(parts) if parts else "")


def lane_detail(d: dict) -> str:
    if d.get("status") not in ("ok", "partial"):
        return str(d.get("status"))
    rows = []
    for label in ("lean", "checked"):
        r = d.get(label)
        if r:
            rows.append(f"{label} {r['us_per_tensor_wall']:.2f} us wall / {r['us_per_tensor_cpu']:.2f} us CPU")
    detail = ("MOCK " if (d.get("args") or {}).get("mock") else "") + "per tensor: " + ", ".join(rows)
    if "lean" in d:
        detail += f"; {d['lean']['events_per_pass']:.1f} events/pass"
    pc = d.get("python_calls")
    if pc:
        detail += (f"; Python calls: get_device {pc['get_device_us']:.2f}, raw stream {pc['raw_stream_us']:.2f}, "
                   f"record_stream {pc['record_stream_us']:.2f} us")
    return ("partial: " if d.get("status") == "partial" else "") + detail


def check_word(r: dict) -> str:
    """bit_exact: True, False, or None when every check replay was dropped (nothing compared)."""
    if "bit_exact" not in r:
        return ""
    if r["bit_exact"] is None:
        return " unchecked (check replays dropped)"
    return "" if r["bit_exact"] else " NOT bit-exact"


def graphs_detail(d: dict) -> str:
    parts = []
    for role, r in (d.get("roles") or {}).items():
        if r.get("status") != "ok":
            parts.append(f"{role}: {r.get('status')}")
            continue
        drops = (f"dropped {r['dropped_timed']}/{r['timed_dumped_replays']} timed"
                 if "dropped_timed" in r else f"dropped {r.get('dropped_passes')}")
        parts.append(f"{role} {fmt_x(r['ratio'])} ({drops}; {r['replay_s_plain'] * 1e3:.2f} ms, "
                     f"{r['tensors_per_pass']} t/pass)" + check_word(r))
    detail = "; ".join(parts) or str(d.get("status", ""))
    return ("partial: " + detail) if d.get("partial") else detail


def decode_detail(d: dict) -> str:
    parts = []
    for mode, e in (d.get("modes") or {}).items():
        if mode == "none":
            continue
        if e.get("status") != "ok":
            parts.append(f"{mode}: {e.get('status')}")
            continue
        ratios = [f"{role} {fmt_x(v.get('ratio_to_none'))}" for role, v in e.get("roles", {}).items()]
        parts.append(f"{mode}: " + " ".join(ratios) + ("" if e.get("bit_exact_vs_none") else " NOT bit-exact"))
    detail = "; ".join(parts)
    if d.get("partial"):
        runs = ", ".join(f"{m} {n}" for m, n in (d.get("runs_done") or {}).items())
        detail = f"partial (runs of {d.get('config', {}).get('reps')}: {runs}): " + detail
    return detail


RESULT_FILES = {  # stage -> (its JSON file, the key in summary.json, detail function)
    "d2h-bench": ("d2h.json", "d2h", d2h_detail),
    "d2h-decode": ("d2h-decode.json", "d2h_decode", d2h_detail),
    "lane-bench": ("lane.json", "lane", lane_detail),
    "decode-graphs": ("graphs.json", "graphs", graphs_detail),
    "decode-bench": ("decode.json", "decode", decode_detail),
}


def main(argv: list[str]) -> int:
    out, work, budget, dry = Path(argv[0]), Path(argv[1]), int(argv[2]), argv[3] == "1"
    log = (out / "gpu_check.log").read_bytes()
    summary: dict = {"budget_s": budget, "dry_run": dry, "stages": {}, "results": {}}
    rows = []
    for line in (work / "stages.tsv").read_text().splitlines():
        name, status, secs, rc, limit, start, end = line.split("\t")
        summary["stages"][name] = {"status": status, "seconds": int(secs), "rc": rc, "limit_s": int(limit)}
        text = log[int(start):int(end)].decode(errors="replace")
        try:
            detail = ""
            if status.startswith("skipped"):
                pass
            elif name == "deps":
                m = re.findall(r"^(all present: .*|missing: .*)$", text, re.M)
                detail = m[-1] if m else ""
            elif name == "build":
                detail = ", ".join(sorted(set(re.findall(r'"name": "([^"]+)"', text))))
            elif name == "pytest-cuda":
                detail, info = pytest_detail(text, work / "pytest-cuda.xml")
                summary["results"]["pytest"] = info
            elif name in RESULT_FILES:
                file, key, describe = RESULT_FILES[name]
                d = load(work, file)
                if d is None:
                    detail = f"no {file}"
                else:
                    detail = describe(d)
                    summary["results"][key] = d
        except Exception as exc:  # one odd JSON must not cost the table
            detail = f"(summary error: {type(exc).__name__}: {exc})"
        summary["stages"][name]["result"] = detail
        if len(detail) > DETAIL_CHARS:
            detail = detail[:DETAIL_CHARS - 3] + "..."
        rows.append((name, status, f"{secs}s", detail))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")

    head = ("stage", "status", "time", "result")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    fmt = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    print(fmt(head))
    print("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for r in rows:
        print(fmt(r))
    ok = sum(1 for s in summary["stages"].values() if s["status"] == "ok")
    print(f"{ok} of {len(rows)} stages ok. In {out}: gpu_check.log, summary.json, results.tar.gz "
          f"(benchmark JSON, pytest junit XML, stages.tsv)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
