"""Which way the C++ hot path reads a tensor: its TensorImpl (``fastdump._torch_reader``) or its
Python attributes.

``ChannelStager.stage_tensor`` needs seven facts per tensor (device, dtype, layout, negation bit,
shape, strides, data pointer). Through Python attributes they cost a small model's decode step more
than fastdump's copy and bookkeeping together (issue 11, ``benchmarks/RESULTS.md``). The optional
extension ``fastdump._torch_reader`` (``csrc/torch_reader.cpp``) reads them from the TensorImpl; it
is compiled against one torch and imports only under that torch version. It exists when fastdump
was installed with torch importable at build time (``pip install --no-build-isolation``).

``install()`` hands it to ``fastdump._C`` once per process, when the first channel opens; without it
(not built, another torch, ``FASTDUMP_TORCH_READER=0``) the attribute reads stay, with the same
results. ``describe()`` says which is in use and why (``fastdump info``, benchmarks).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

from .. import _C, fsutil

_lock = threading.Lock()
fsutil.renew_locks_at_fork(sys.modules[__name__], "_lock")
_state: dict | None = None  # install()'s answer, once
_capsule = None  # the reader's table, once loaded


def install() -> dict:
    """Hands the reader to fastdump._C if it can be used here; returns describe()."""
    global _state, _capsule
    with _lock:
        if _state is None:
            state = _probe()
            _capsule = state.pop("_capsule", None)
            if _capsule is not None:
                _C.set_tensor_reader(_capsule)
            _state = state
        return dict(_state)


def set_enabled(on: bool) -> dict:
    """Switches an installed reader off (attribute reads) or back on, process-wide: for measuring
    the two side by side (benchmarks/paired_step_bench.py --compare-reader). Returns describe()."""
    global _state
    install()
    with _lock:
        if _capsule is not None:
            _C.set_tensor_reader(_capsule if on else None)
            _state = {**_state, "reader": "torch" if on else "attributes",
                      "why": "built against this torch" if on else "switched off (set_enabled)"}
        return dict(_state)


def describe() -> dict:
    """{"reader": "torch" | "attributes", "torch": its torch version or None, "why": str}."""
    if _state is not None:
        return dict(_state)
    state = _probe()
    state.pop("_capsule", None)
    return state


def _probe() -> dict:
    if os.environ.get("FASTDUMP_TORCH_READER", "") == "0":
        return {"reader": "attributes", "torch": None, "why": "FASTDUMP_TORCH_READER=0"}
    if "torch" not in sys.modules:  # never import torch for a process that does not use it
        return {"reader": "attributes", "torch": None, "why": "torch is not imported"}
    try:
        # After torch (it links torch's libraries, which that import loaded).
        _torch_reader = importlib.import_module("fastdump._torch_reader")
    except ImportError as exc:
        return {"reader": "attributes", "torch": None, "why": f"fastdump._torch_reader unavailable: {exc}"}
    return {"reader": "torch", "torch": _torch_reader.TORCH_VERSION, "why": "built against this torch",
            "_capsule": _torch_reader.READER}
