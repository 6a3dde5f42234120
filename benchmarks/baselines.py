"""The dumpers fastdump is measured against, implemented faithfully inside the benchmarks.

* ``SGLangStyleDumper`` - what SGLang's ``--debug-tensor-dump-output-folder`` does
  (``sglang/srt/debug_utils/tensor_dump_forward_hook.py``, re-implemented from its behaviour):
  forward hooks on every leaf module plus the top-level child named ``model``; ``.cpu()`` of every
  output inside the hook (each element of a tuple/list output, kept as a list under one name);
  when the top-level ``model`` hook fires, the tensors gathered so far are written with
  ``torch.save`` to ``Pass{id:05d}.pt`` *on the forward thread*, and only then is ``model``'s own
  output added - so the top-level output and the LM head's output land in the *next* pass file,
  and the last pass's ones are never written. One directory per rank,
  ``TP{tp}_PP{pp}_Rank{tp_size*pp+tp}_pid{pid}``, under ``draft/`` or ``target/`` for EAGLE
  (SGLang PR #21694).
* ``NaiveH5Dumper`` - the obvious "make it async" attempt: the hook snapshots (``.cpu()`` on a
  GPU, ``clone()`` on a CPU) and enqueues; a writer thread creates one h5py dataset per tensor per
  pass. Per-dataset HDF5 cost (~250 µs) and the GIL make it fall behind on decode.

On a CPU, ``.cpu()`` returns the tensor itself, so the faithful SGLang-style dumper keeps
*references* and later in-place ops (the fused add+RMSNorm) change what it saves - cheap and
wrong. ``SGLangStyleDumper(copy_on_cpu=True)`` clones instead, which is what SGLang's ``.cpu()``
costs on a GPU (a real copy per tensor); the benchmarks call that variant ``sglang-style-clone``.

Both record only while *their own* model's forward runs. The benchmark's draft shares the
target's embedding and LM head module objects, so without that guard each role's hooks would also
fire in the other role's passes; SGLang shares only the weights (its hooks never see the other
model), and this guard reproduces that. It costs one attribute read per hook.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Iterator

import torch
from torch import nn


def rank_dir_name(tp_size: int = 1, tp_rank: int = 0, pp_rank: int = 0, pid: int | None = None) -> str:
    """SGLang's per-rank directory name (fastdump uses the same one)."""
    rank = tp_size * pp_rank + tp_rank
    return f"TP{tp_rank}_PP{pp_rank}_Rank{rank}_pid{os.getpid() if pid is None else pid}"


def leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if not module._modules]


def iter_output_tensors(name: str, output) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten a module output into ``(name, tensor)`` with the dump naming convention:
    tuple/list elements ``name.0``, ``name.1``; dict entries ``name.<key>``; non-tensors skipped."""
    if isinstance(output, torch.Tensor):
        yield name, output
    elif isinstance(output, (tuple, list)):
        for index, item in enumerate(output):
            yield from iter_output_tensors(f"{name}.{index}", item)
    elif isinstance(output, dict):
        for key, item in output.items():
            yield from iter_output_tensors(f"{name}.{key}", item)


class _OwnPassGuard:
    """Knows whether the guarded model's own forward is running (see module docstring)."""

    def __init__(self):
        self.active = False
        self._handles: list = []

    def watch(self, model: nn.Module, on_begin=None, on_end=None) -> None:
        def pre_hook(_module, _args):
            self.active = True
            if on_begin is not None:
                on_begin()

        def post_hook(_module, _args, output):
            if on_end is not None:
                on_end(output)
            self.active = False

        self._handles.append(model.register_forward_pre_hook(pre_hook))
        self._handles.append(model.register_forward_hook(post_hook))

    def add_handle(self, handle) -> None:
        self._handles.append(handle)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# --------------------------------------------------------------------------------------------
# SGLang-style synchronous dumper
# --------------------------------------------------------------------------------------------


def _clone_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


class SGLangStyleDumper:
    def __init__(self, model: nn.Module, dump_dir: str | os.PathLike, *, role: str | None = None,
                 tp_size: int = 1, tp_rank: int = 0, pp_rank: int = 0, top_level_name: str = "model",
                 copy_on_cpu: bool = False):
        base = Path(dump_dir) / role if role else Path(dump_dir)
        self._copy = _clone_to_cpu if copy_on_cpu else torch.Tensor.cpu
        self.process_dir = base / rank_dir_name(tp_size, tp_rank, pp_rank)
        self.process_dir.mkdir(parents=True, exist_ok=True)
        self._forward_pass_id = 0
        self._current: dict[str, object] = {}
        self.tensors = 0
        self.bytes = 0
        self._guard = _OwnPassGuard()
        self._guard.watch(model)
        if not self._hook_recursive(model, prefix="", top_level_name=top_level_name):
            raise ValueError(f"model has no top-level child named {top_level_name!r} (SGLang requires one)")

    # SGLang walks ``_modules`` itself: a module is hooked if it has no children, or if it is
    # the top-level child named "model" (which then also closes the pass).
    def _hook_recursive(self, module: nn.Module, prefix: str, top_level_name: str) -> bool:
        found_top_level = False
        for child_name, child in module._modules.items():
            if child is None:
                continue
            full_name = f"{prefix}.{child_name}" if prefix else child_name
            is_top_level = not prefix and child_name == top_level_name
            found_top_level |= is_top_level
            found_top_level |= self._hook_recursive(child, full_name, top_level_name)
            if not child._modules or is_top_level:
                self._guard.add_handle(child.register_forward_hook(self._make_hook(full_name, is_top_level)))
        return found_top_level

    def _make_hook(self, name: str, is_top_level: bool):
        def hook(_module, _inputs, output):
            if not self._guard.active:
                return
            if is_top_level:
                self._save_current_pass()
            if output is not None:
                self._add(name, output)

        return hook

    def _add(self, name: str, output) -> None:
        if isinstance(output, (tuple, list)):
            copies = [self._copy(item) for item in output if isinstance(item, torch.Tensor)]
            if not copies:
                return
            self._current[name] = copies[0] if len(copies) == 1 else copies
        elif isinstance(output, torch.Tensor):
            copies = [self._copy(output)]
            self._current[name] = copies[0]
        else:
            return  # SGLang logs "Unsupported type" and moves on
        self.tensors += len(copies)
        self.bytes += sum(c.nbytes for c in copies)

    def _save_current_pass(self) -> None:
        if not self._current:
            return
        torch.save(self._current, self.process_dir / f"Pass{self._forward_pass_id:05d}.pt")
        self._current = {}
        self._forward_pass_id += 1

    def close(self) -> float:
        """Remove the hooks. Like SGLang, the pending top-level/LM-head outputs are not written."""
        self._guard.remove_hooks()
        return 0.0

    def stats(self) -> dict:
        return {"passes": self._forward_pass_id, "tensors": self.tensors, "bytes": self.bytes,
                "dropped": 0, "status": "ok", "error": None}


# --------------------------------------------------------------------------------------------
# Naive asynchronous h5py dumper
# --------------------------------------------------------------------------------------------


def _to_storable_numpy(tensor: torch.Tensor):
    """numpy array h5py can store; dtypes numpy lacks (bf16, fp8) travel as same-width ints."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    if tensor.is_floating_point() and tensor.element_size() == 1:
        return tensor.view(torch.uint8).numpy()  # float8 families
    return tensor.numpy()


class NaiveH5Dumper:
    """Hook -> snapshot -> queue -> writer thread -> one h5py dataset per tensor per pass.

    With ``model=None`` it has no hooks and is driven by hand: ``begin_pass()``, ``dump(name, t)``,
    ``end_pass()`` (the writer benchmark does this). The queue is bounded (``max_queue`` tensors)
    so a slow writer eventually blocks the forward thread instead of exhausting memory.
    """

    def __init__(self, model: nn.Module | None, dump_dir: str | os.PathLike, *, role: str | None = None,
                 tp_size: int = 1, tp_rank: int = 0, pp_rank: int = 0, max_queue: int = 4096,
                 root_name: str = "output"):
        import h5py  # noqa: PLC0415 - only this baseline needs it

        base = Path(dump_dir) / role if role else Path(dump_dir)
        self.rank_dir = base / rank_dir_name(tp_size, tp_rank, pp_rank)
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.rank_dir / "dump.h5"
        self._file = h5py.File(self.path, "w")
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._pass_id = -1
        self._calls_in_pass: dict[str, int] = {}
        self.passes = 0
        self.tensors = 0
        self.bytes = 0
        self.error: str | None = None
        self._writer = threading.Thread(target=self._write_loop, name="naive-h5-writer", daemon=True)
        self._writer.start()

        self._guard = _OwnPassGuard()
        if model is not None:
            self._guard.watch(model, on_begin=self.begin_pass,
                              on_end=lambda output: self._end_hooked_pass(root_name, output))
            for name, module in leaf_modules(model):
                self._guard.add_handle(module.register_forward_hook(self._make_hook(name)))

    # -- capture side (forward thread) --------------------------------------------------------

    def _make_hook(self, name: str):
        def hook(_module, _inputs, output):
            if self._guard.active:
                for tensor_name, tensor in iter_output_tensors(name, output):
                    self.dump(tensor_name, tensor)

        return hook

    def begin_pass(self) -> None:
        self._pass_id += 1
        self._calls_in_pass.clear()

    def end_pass(self) -> None:
        self.passes += 1

    def _end_hooked_pass(self, root_name: str, output) -> None:
        for tensor_name, tensor in iter_output_tensors(root_name, output):
            self.dump(tensor_name, tensor)
        self.end_pass()

    def dump(self, name: str, tensor: torch.Tensor) -> None:
        repeat = self._calls_in_pass.get(name, 0)
        self._calls_in_pass[name] = repeat + 1
        if repeat:
            name = f"{name}#{repeat}"
        snapshot = tensor.detach()
        # .cpu() of a CPU tensor is the tensor itself, which later in-place ops would change.
        snapshot = snapshot.clone() if snapshot.device.type == "cpu" else snapshot.cpu()
        self.tensors += 1
        self.bytes += snapshot.nbytes
        self._queue.put((self._pass_id, name, snapshot))

    # -- writer thread -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # keep draining so the forward thread never blocks on a dead writer
            pass_id, name, tensor = item
            try:
                group = self._file.require_group(f"pass{pass_id:05d}")
                dataset = group.create_dataset(name, data=_to_storable_numpy(tensor))
                dataset.attrs["dtype"] = str(tensor.dtype).removeprefix("torch.")
            except Exception as exc:  # disk full, bad name...: stop writing, keep serving
                self.error = f"{type(exc).__name__}: {exc}"

    def close(self) -> float:
        """Flush everything queued, close and fsync the file; return the seconds that took.

        fsync, because the raw-write reference and fastdump's segments are on disk when they are
        done; without it the page cache would make this baseline look faster than the disk.
        """
        start = time.perf_counter()
        self._guard.remove_hooks()
        self._queue.put(None)
        self._writer.join()
        self._file.close()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def stats(self) -> dict:
        return {"passes": self.passes, "tensors": self.tensors, "bytes": self.bytes, "dropped": 0,
                "status": "error" if self.error else "ok", "error": self.error}
