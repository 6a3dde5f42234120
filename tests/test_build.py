"""setup.py's CUDA toolkit lookup, on fake toolkit trees (no compiler run)."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import runpy, setuptools
setuptools.setup = lambda **kw: None  # only the module-level lookup runs
g = runpy.run_path("setup.py")
print(g["CUDA_HOME"], g["CUDART_DIR"], g["CUDA_INCLUDE"], g["WITH_CUDA"], sep="|")
"""


def _toolkit(root: Path, lib: str, include: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (root / lib).mkdir(parents=True)
    (root / lib / "libcudart_static.a").write_bytes(b"!<arch>\n")
    (root / include).mkdir(parents=True, exist_ok=True)
    (root / include / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    return root


def _probe(home: Path):
    env = dict(os.environ, CUDA_HOME=str(home), FASTDUMP_CUDA="1", FASTDUMP_TORCH_READER="0",
               PATH="/usr/bin:/bin")  # no nvcc on PATH: CUDA_HOME is the only candidate besides /usr/local/cuda
    env.pop("CUDA_PATH", None)
    p = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1].split("|")


@pytest.mark.parametrize("lib,include", [
    ("lib64", "include"),
    ("lib", "include"),
    # CUDA 12/13 images and distribution packages that keep the runtime only under targets/
    ("targets/x86_64-linux/lib", "targets/x86_64-linux/include"),
    ("targets/sbsa-linux/lib", "targets/sbsa-linux/include"),
])
def test_static_runtime_found_where_the_toolkit_keeps_it(tmp_path, lib, include):
    home = _toolkit(tmp_path / "cuda", lib, include)
    found_home, cudart_dir, cuda_include, with_cuda = _probe(home)
    assert found_home == str(home)
    assert cudart_dir == str(home / lib)
    assert cuda_include == str(home / include)
    assert with_cuda == "True"


def test_no_static_runtime_is_no_toolkit(tmp_path):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    env = dict(os.environ, CUDA_HOME=str(home), FASTDUMP_CUDA="1", FASTDUMP_TORCH_READER="0", PATH="/usr/bin:/bin")
    p = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    if Path("/usr/local/cuda/bin/nvcc").exists():  # (this machine's toolkit is a candidate too)
        assert p.returncode == 0 and p.stdout.strip().split("|")[0] == "/usr/local/cuda"
    else:
        assert p.returncode != 0 and "libcudart_static.a" in p.stderr
