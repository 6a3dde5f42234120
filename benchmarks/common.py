"""Helpers shared by the benchmark scripts: timing, tables, JSON, machine description, dump dirs.

Nothing here knows about a particular benchmark; the scripts import from this module and from
``baselines.py`` (the dumpers fastdump is compared against) and ``models.py`` (the target/draft).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

# --------------------------------------------------------------------------------------------
# fastdump import: the library is built alongside the benchmarks, so a missing or half-built
# package must turn the fastdump rows into "unavailable" instead of failing the whole run.
# --------------------------------------------------------------------------------------------


def import_fastdump():
    """Return ``(module, None)`` or ``(None, reason)`` when ``import fastdump`` fails."""
    try:
        import fastdump  # noqa: PLC0415 - optional on purpose
    except Exception as exc:  # ImportError, or any error raised while the package initializes
        return None, f"import fastdump failed: {type(exc).__name__}: {exc}"
    if not hasattr(fastdump, "attach"):
        return None, "fastdump has no attach() yet"
    return fastdump, None


# --------------------------------------------------------------------------------------------
# Devices, dtypes, timing
# --------------------------------------------------------------------------------------------

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPE_NAMES[name.lower()]
    except KeyError:
        raise SystemExit(f"unknown dtype {name!r}; choose from {sorted(_DTYPE_NAMES)}") from None


def stream_synchronizer(device: torch.device) -> Callable[[], None]:
    """Return a function that waits for the work queued on the *current* stream of ``device``.

    Deliberately not ``torch.cuda.synchronize()``: a device-wide sync would also wait for
    fastdump's side-stream device-to-host drain, which is designed to overlap with the next
    step; a serving loop only ever waits on its own stream (to read sampled tokens). The
    baselines do their copies on the current stream, so they are charged in full either way.
    """
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        return stream.synchronize
    return lambda: None


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def round_robin(modes: Sequence[str], rep: int) -> list[str]:
    """Repetition ``rep``'s order: every mode once, starting one further each repetition, so no
    mode always runs first (cold caches, clock ramps) and each mode runs close in time to the others."""
    shift = rep % len(modes)
    return list(modes[shift:]) + list(modes[:shift])


def parse_modes(text: str, allowed: Sequence[str], error: Callable[[str], None],
                always_first: str | None = None) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, checked against ``allowed`` (``error`` is ``parser.error``)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(allowed))
    if unknown:
        error(f"unknown modes: {unknown}; choose from {', '.join(allowed)}")
    if always_first and always_first not in modes:
        modes.insert(0, always_first)  # the reference every ratio is computed against
    return modes


class Stopwatch:
    """``with Stopwatch(sync) as sw: ...`` then ``sw.seconds``; syncs the stream on both ends."""

    def __init__(self, sync: Callable[[], None] = lambda: None):
        self._sync = sync
        self.seconds = float("nan")

    def __enter__(self):
        self._sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self._start
        return False


# --------------------------------------------------------------------------------------------
# Output: tables, numbers, JSON
# --------------------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table (also valid GitHub markdown), so it can be pasted into RESULTS.md."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), separator] + [line(r) for r in cells[1:]])


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:  # None or NaN
        return "-"
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None or ratio != ratio else f"{ratio:.3f}x"


def fmt_rate(value: float | None, unit: str = "") -> str:
    if value is None or value != value:
        return "-"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.1f} {unit}".rstrip()


def write_json(path: str | os.PathLike | None, payload: dict) -> None:
    """Written to a temporary file, then renamed over ``path``: a process killed mid-write (a stage
    timeout in gpu_check.sh) leaves the previous complete version, never half a file. The scripts
    call it after every finished piece of work, so a killed run still leaves its partial results."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def tensor_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the exact bytes of ``tensors`` (any dtype): 'bit-exact' made comparable."""
    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().contiguous().reshape(-1).cpu()
        # numpy has no bfloat16/float8: hash the raw bits through a same-width integer view.
        raw = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(
            {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Machine description and dump directories
# --------------------------------------------------------------------------------------------


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: torch.device | None = None) -> dict:
    info = {
        "cpu": cpu_model_name(),
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "load_average": load_average(),
    }
    try:
        import h5py  # noqa: PLC0415

        info["h5py"] = h5py.__version__
        info["hdf5"] = h5py.version.hdf5_version
    except ImportError:
        pass
    try:
        from fastdump.staging import tensor_reader  # noqa: PLC0415

        info["tensor_reader"] = tensor_reader.describe()["reader"]  # "torch" or "attributes"
    except ImportError:
        pass
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def default_dump_root(benchmark: str) -> Path:
    """A fresh temp dir under /tmp for one run's dumps (deleted rep by rep unless kept)."""
    return Path(tempfile.mkdtemp(prefix=f"fastdump-{benchmark}-", dir="/tmp"))


def remove_tree(path: str | os.PathLike) -> None:
    shutil.rmtree(path, ignore_errors=True)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def print_header(title: str, info: dict) -> None:
    print(f"== {title} ==")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    load = info.get("load_average")
    if load and info.get("nproc") and load[0] > 0.5 * info["nproc"]:
        # Ratios are measured side by side, but a busy machine still widens the spread.
        print(f"WARNING: machine is busy (1-min load {load[0]} on {info['nproc']} CPUs); numbers will be noisy")
