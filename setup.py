"""Build fastdump and its extensions fastdump._C and, where torch is importable, fastdump._torch_reader.

fastdump._C never links libtorch. When a CUDA toolkit is found (CUDA_HOME, or nvcc on PATH) the
CUDA staging sources are compiled with nvcc and the CUDA runtime is linked statically, so the
same build imports on machines without a GPU or driver (it detects GPUs at run time). Set
FASTDUMP_CUDA=0 to force a CPU-only build, FASTDUMP_CUDA=1 to fail when no toolkit is found.

fastdump._torch_reader (csrc/torch_reader.cpp) reads tensors' shapes, strides and pointers from
their TensorImpl instead of their Python attributes: the per-tensor cost that dominates a small
model's decode step. It is compiled against the torch this build can import, and imports only under
that same torch version, so it is built only when torch is importable here: install with
`pip install --no-build-isolation` (pip's isolated build environment has no torch). Without it
fastdump works the same, a little slower per tensor. FASTDUMP_TORCH_READER=0 skips it,
FASTDUMP_TORCH_READER=1 fails when torch cannot be imported.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent.resolve()
CSRC = "csrc"
CUDA_ARCHS = os.environ.get("FASTDUMP_CUDA_ARCHS", "80;90")


# Where toolkits keep libcudart_static.a: lib64 (the runfile's symlink), lib, or only the target
# directory (some distribution packages and container images of CUDA 12/13).
CUDART_SUBDIRS = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib", "targets/aarch64-linux/lib")


def cudart_static_dir(home):
    """The directory of ``home`` holding the static CUDA runtime, or None."""
    for sub in CUDART_SUBDIRS:
        if (Path(home) / sub / "libcudart_static.a").is_file():
            return str(Path(home) / sub)
    return None


def find_cuda_home():
    if os.environ.get("FASTDUMP_CUDA", "") == "0":
        return None
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for home in filter(None, candidates):
        # A toolkit has both the compiler and the static runtime we link.
        if (Path(home) / "bin" / "nvcc").exists() and cudart_static_dir(home):
            return home
    if os.environ.get("FASTDUMP_CUDA", "") == "1":
        sys.exit("FASTDUMP_CUDA=1 but no CUDA toolkit was found (nvcc and libcudart_static.a under one of "
                 f"{', '.join(CUDART_SUBDIRS)}; set CUDA_HOME)")
    return None


CUDA_HOME = find_cuda_home()
CUDART_DIR = cudart_static_dir(CUDA_HOME) if CUDA_HOME else None
# The headers next to that library (targets/<arch>/include when only that directory has it).
CUDA_INCLUDE = None
if CUDA_HOME:
    beside = Path(CUDART_DIR).parent / "include"
    CUDA_INCLUDE = str(beside) if (beside / "cuda_runtime_api.h").is_file() else f"{CUDA_HOME}/include"
CUDA_SOURCES = sorted(str(p.relative_to(HERE)) for p in (HERE / CSRC).glob("*.cu"))
WITH_CUDA = CUDA_HOME is not None and bool(CUDA_SOURCES)


def cuda_major(include):
    """The toolkit's major version (CUDART_VERSION in ``include``/cuda_runtime_api.h: 13000 -> 13), or None."""
    try:
        for line in (Path(include) / "cuda_runtime_api.h").read_text(errors="replace").splitlines():
            if line.startswith("#define CUDART_VERSION"):
                return int(line.split()[2]) // 1000
    except (OSError, ValueError, IndexError, TypeError):
        pass
    return None


def cupy_requirement():
    """CuPy's wheels are per CUDA major (cupy-cuda12x, cupy-cuda13x): the one matching the toolkit this
    build found; FASTDUMP_CUPY overrides; without a toolkit, the newest (CUDA 13)."""
    if os.environ.get("FASTDUMP_CUPY"):
        return os.environ["FASTDUMP_CUPY"]
    major = cuda_major(CUDA_INCLUDE) if CUDA_HOME else None
    return f"cupy-cuda{major if major and major >= 11 else 13}x"


EXTRAS = {
    "torch": ["torch"],  # not pinned: an engine brings its own build (CI installs the CPU one)
    "cuda": [cupy_requirement(), "nvidia-ml-py"],
    # pybind11: tests build a mock-CUDA copy of the extension; pytest-timeout: a hung test fails
    # alone instead of running CI past its limit.
    "test": ["pytest", "pytest-timeout", "pybind11>=2.12"],
    "hf": ["transformers>=4.57"],
}


class BuildExt(build_ext):
    """Compiles the .cu sources with nvcc before the C++ link; an optional tensor reader that does
    not compile (a compiler without C++20, torch without its headers) is left out, not fatal."""

    def build_extensions(self):
        self._left_out = set()
        super().build_extensions()
        # An extension left out must not be copied in place or listed as an output (pip would fail).
        self.extensions = [ext for ext in self.extensions if ext.name not in self._left_out]

    def build_extension(self, ext):
        if WITH_CUDA and ext.name == "fastdump._C":
            ext.extra_objects = [*ext.extra_objects, *self._nvcc(ext)]
        if ext.name != "fastdump._torch_reader" or os.environ.get("FASTDUMP_TORCH_READER") == "1":
            return super().build_extension(ext)
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError, LinkError, a missing header: fastdump works without it
            self._left_out.add(ext.name)
            print(f"fastdump: fastdump._torch_reader not built ({type(exc).__name__}: {exc}); tensors are "
                  "read through their Python attributes (FASTDUMP_TORCH_READER=1 makes this an error)",
                  file=sys.stderr, flush=True)

    def _nvcc(self, ext):
        import pybind11
        import sysconfig

        out = Path(self.build_temp) / "cuda"
        out.mkdir(parents=True, exist_ok=True)
        gencode = []
        archs = [a for a in CUDA_ARCHS.split(";") if a]
        for arch in archs:
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        # PTX of the newest arch, so newer GPUs JIT-compile it.
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
        objects = []
        for src in CUDA_SOURCES:
            obj = out / (Path(src).stem + ".o")
            cmd = [
                str(Path(CUDA_HOME) / "bin" / "nvcc"), "-c", src, "-o", str(obj),
                "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                "-DFASTDUMP_WITH_CUDA=1", f"-I{CSRC}", f"-I{pybind11.get_include()}",
                f"-I{sysconfig.get_paths()['include']}", *gencode,
            ]
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd, cwd=HERE)
            objects.append(str(obj))
        return objects


sources = [f"{CSRC}/module.cpp", f"{CSRC}/forward_wrapper.cpp", f"{CSRC}/ring.cpp", f"{CSRC}/crc32c.cpp",
           f"{CSRC}/writer_rows.cpp", f"{CSRC}/writer_rows_bindings.cpp"]
ext_kwargs = dict(include_dirs=[CSRC], extra_compile_args=["-O3"], libraries=["rt"])
if WITH_CUDA:
    sources += [f"{CSRC}/cuda_bindings.cpp", f"{CSRC}/cuda_graph_bindings.cpp"]
    ext_kwargs.update(
        include_dirs=[CSRC, CUDA_INCLUDE],
        define_macros=[("FASTDUMP_WITH_CUDA", "1")],
        library_dirs=[CUDART_DIR],
        # Static runtime: no libcudart.so needed at import time; the driver is found at run time.
        libraries=["cudart_static", "dl", "rt", "pthread"],
    )
else:
    sources.append(f"{CSRC}/cuda_stub.cpp")


def torch_reader_extension():
    """fastdump._torch_reader against the importable torch's headers, or None (see the docstring)."""
    wanted = os.environ.get("FASTDUMP_TORCH_READER", "")
    if wanted == "0":
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        if wanted == "1":
            sys.exit(f"FASTDUMP_TORCH_READER=1 but torch cannot be imported here ({exc}); "
                     "pip's build isolation hides it: use pip install --no-build-isolation")
        print(f"fastdump: not building fastdump._torch_reader: torch cannot be imported here ({exc})", flush=True)
        return None
    from setuptools import Extension

    version = str(torch.__version__)
    return Extension(
        "fastdump._torch_reader",
        [f"{CSRC}/torch_reader.cpp"],
        include_dirs=[CSRC, *cpp_extension.include_paths()],
        library_dirs=cpp_extension.library_paths(),
        libraries=["c10", "torch_python"],  # THPVariableClass, THPDtypeType; the rest is inline
        define_macros=[("FASTDUMP_TORCH_VERSION", f'"{version}"'),
                       ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))],
        extra_compile_args=["-O3", "-std=c++20", "-fvisibility=hidden"],  # torch >= 2.10 headers want C++20
        language="c++",
    )


extensions = [Pybind11Extension("fastdump._C", sources, cxx_std=17, **ext_kwargs)]
if (reader := torch_reader_extension()) is not None:
    extensions.append(reader)

setup(
    ext_modules=extensions,
    extras_require=EXTRAS,
    cmdclass={"build_ext": BuildExt},
)
