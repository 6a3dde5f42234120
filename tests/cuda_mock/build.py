"""Build fastdump._C's sources against the mock CUDA runtime (tests/cuda_mock/cuda_runtime.h).

The result is a separate extension module, loaded under the name ``_C`` from its own directory. Its
C++ namespace is renamed (``-Dfastdump=fastdump_mock``) so its pybind11 types do not clash with the
real ``fastdump._C`` loaded in the same process. The build is cached by source hash under build/.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOCK = Path(__file__).resolve().parent
SOURCES = ["csrc/module.cpp", "csrc/forward_wrapper.cpp", "csrc/ring.cpp", "csrc/crc32c.cpp", "csrc/writer_rows.cpp",
           "csrc/writer_rows_bindings.cpp", "csrc/cuda_bindings.cpp", "csrc/cuda_staging.cu",
           "csrc/cuda_graph_record.cu", "csrc/cuda_graph_bindings.cpp"]
HEADERS = ["csrc/ring.h", "csrc/strided_copy.h", "csrc/bindings.h", "csrc/cuda_staging.h", "csrc/crc32c.h",
           "csrc/cuda_graph_record.h", "csrc/writer_rows.h"]


def _flags(extra=()):
    import pybind11

    return ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-DFASTDUMP_CUDA_MOCK=1",
            "-DFASTDUMP_WITH_CUDA=1", "-Dfastdump=fastdump_mock", f"-I{MOCK}", f"-I{ROOT / 'csrc'}",
            f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", *extra]


def build(opt: str = "-O1", extra=(), tag: str = "") -> Path:
    """Compile (or reuse) the mock extension; returns the path of the .so."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler")
    h = hashlib.sha256()
    for rel in SOURCES + HEADERS + ["tests/cuda_mock/cuda_runtime.h"]:
        h.update((ROOT / rel).read_bytes())
    h.update(" ".join([cxx, opt, *extra, sysconfig.get_config_var("EXT_SUFFIX") or ""]).encode())
    out = ROOT / "build" / f"cuda_mock{tag}-{h.hexdigest()[:16]}"
    so = out / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    if so.exists():
        return so
    out.mkdir(parents=True, exist_ok=True)
    procs, objs = [], []
    for src in SOURCES:  # in parallel: about 20 s on 2 cores
        obj = out / (Path(src).stem + ".o")
        lang = ["-x", "c++"] if src.endswith(".cu") else []
        cmd = [cxx, *lang, *_flags(extra), opt, "-c", str(ROOT / src), "-o", str(obj)]
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        objs.append(str(obj))
    for (cmd, p), src in zip(procs, SOURCES):
        text, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"mock build failed: {' '.join(cmd)}\n{text}")
        if "warning" in text:  # shown, not fatal: other compilers warn differently
            print(f"mock build warnings ({src}):\n{text}", file=sys.stderr)
    tmp = so.with_suffix(".tmp")
    subprocess.run([cxx, "-shared", *objs, "-o", str(tmp), "-lrt", "-pthread", *extra], check=True)
    tmp.rename(so)
    return so


def driver(name: str, cuda_sources, opt: str = "-O2") -> Path:
    """Compile a standalone C++ driver (tests/cuda_mock/<name>.cpp) with ``cuda_sources`` (csrc/*.cu,
    compiled as C++) and csrc/ring.cpp against the mock runtime; returns the executable's path.
    Raises RuntimeError without a C++ compiler (callers skip)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler")
    out = ROOT / "build" / f"cuda_mock_{name}"
    out.parent.mkdir(exist_ok=True)
    subprocess.run([cxx, "-std=c++17", opt, "-DFASTDUMP_CUDA_MOCK=1", f"-I{MOCK}", f"-I{ROOT / 'csrc'}",
                    "-x", "c++", *(str(ROOT / src) for src in cuda_sources), "-x", "none", str(ROOT / "csrc/ring.cpp"),
                    str(MOCK / f"{name}.cpp"), "-lrt", "-pthread", "-o", str(out)], check=True)
    return out


def load(so: Path):
    loader = importlib.machinery.ExtensionFileLoader("_C", str(so))
    spec = importlib.util.spec_from_file_location("_C", str(so), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    print(build())
