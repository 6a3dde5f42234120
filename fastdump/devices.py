"""GPU facts for rank.json and NUMA placement of the writer process.

NVML (``pip install nvidia-ml-py``, module ``pynvml``) is optional; so is a GPU. Every function
degrades to ``{}`` / ``None`` instead of raising.

A GPU is named by its CUDA ordinal in the *serving* process (``int``), its UUID (``"GPU-..."``) or
its PCI bus id (``"0000:3b:00.0"``; NVML's ``"00000000:3B:00.0"`` is accepted too). Ordinals are
mapped through ``CUDA_VISIBLE_DEVICES``; with NVML's PCI order and CUDA's default
fastest-first order they can still disagree on mixed-GPU hosts, so prefer the bus id where you have
it: ``device_facts()`` (run in the serving process) returns it, and the writer process should be
given that, not the ordinal, because the writer must not initialize CUDA.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from . import _C

log = logging.getLogger("fastdump")

_nvml_state = {"module": None, "tried": False, "error": None}
_cuda_info = None


def cuda_info(refresh: bool = False) -> dict:
    """``_C.cuda_info()``, cached (it asks the driver once). Also ``fastdump.staging.cuda.cuda_info``."""
    global _cuda_info
    if _cuda_info is None or refresh:
        try:
            _cuda_info = dict(_C.cuda_info())
        except Exception as exc:  # a broken driver must not break dumping
            _cuda_info = {"compiled": bool(getattr(_C, "cuda_compiled", lambda: False)()), "reason": str(exc)}
    return _cuda_info


def _nvml():
    """The initialized pynvml module, or None (not installed, no driver)."""
    if _nvml_state["tried"]:
        return _nvml_state["module"]
    _nvml_state["tried"] = True
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded ...
        _nvml_state["error"] = f"{type(exc).__name__}: {exc}"
        return None
    _nvml_state["module"] = pynvml
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def normalize_bus_id(bus_id: str) -> str:
    """'00000000:3B:00.0' (NVML) or '0000:3b:00.0' (CUDA, sysfs) -> '0000:3b:00.0'."""
    bus_id = _text(bus_id).strip().lower()
    parts = bus_id.split(":")
    if len(parts) == 3:
        return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:  # no domain
        return f"0000:{parts[0]}:{parts[1]}"
    return bus_id


def parse_cpulist(text: str) -> set:
    """Linux cpulist ('0-3,8,10-11\\n') -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            step = 1
            if ":" in hi:  # 0-15:2 (stride form)
                hi, step_s = hi.split(":", 1)
                step = int(step_s)
            cpus.update(range(int(lo), int(hi) + 1, step))
        else:
            cpus.add(int(part))
    return cpus


def numa_node_count(sysfs_root: str = "/sys") -> int:
    """NUMA nodes with CPUs or memory (1 when unknown)."""
    nodes = Path(sysfs_root) / "devices" / "system" / "node"
    try:
        n = sum(1 for p in nodes.iterdir() if p.name.startswith("node") and p.name[4:].isdigit())
    except OSError:
        return 1
    return max(n, 1)


def _visible_entry(index: int):
    """CUDA ordinal -> the CUDA_VISIBLE_DEVICES entry it stands for (int, 'GPU-...' or None)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or env.strip() == "":
        return index if env is None else None
    entries = [e.strip() for e in env.split(",") if e.strip()]
    if index >= len(entries):
        return None
    entry = entries[index]
    if entry.isdigit():
        return int(entry)
    return entry  # UUID (possibly abbreviated) or MIG-...


def _cuda_bus_id(index: int):
    """PCI bus id of CUDA ordinal `index` via fastdump._C (only if CUDA is already usable here)."""
    try:
        info = cuda_info()
        for dev in info.get("devices", []):
            if dev.get("index") == index and dev.get("pci_bus_id"):
                return dev
    except Exception:
        pass
    return None


def _nvml_handle(nv, device):
    """NVML handle for an ordinal, UUID or bus id; None if not found."""
    try:
        if isinstance(device, str):
            if device.startswith(("GPU-", "MIG-")):
                return nv.nvmlDeviceGetHandleByUUID(device)
            return nv.nvmlDeviceGetHandleByPciBusId(normalize_bus_id(device))
        entry = _visible_entry(int(device))
        if entry is None:
            return None
        if isinstance(entry, int):
            return nv.nvmlDeviceGetHandleByIndex(entry)
        if entry.startswith("GPU-") and len(entry) < 40:  # abbreviated UUID: match a prefix
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                if _text(nv.nvmlDeviceGetUUID(h)).startswith(entry):
                    return h
            return None
        return nv.nvmlDeviceGetHandleByUUID(entry)
    except Exception:
        return None


def _sysfs_device(bus_id: str, sysfs_root: str) -> Path:
    return Path(sysfs_root) / "bus" / "pci" / "devices" / normalize_bus_id(bus_id)


def _read(path: Path):
    try:
        return path.read_text().strip()
    except OSError:
        return None


def device_facts(device, sysfs_root: str = "/sys", query_cuda: bool = True) -> dict:
    """name, uuid, pci_bus_id, driver, total_memory, pcie link (gen/width, current and max), numa_node.

    From NVML when available, else from fastdump's CUDA query (``query_cuda``: serving process only,
    it initializes CUDA) and sysfs. ``{}`` when nothing is known about ``device``.
    """
    facts: dict = {}
    nv = _nvml()
    if nv is not None:
        h = _nvml_handle(nv, device)
        if h is not None:
            for key, fn in (("name", "nvmlDeviceGetName"), ("uuid", "nvmlDeviceGetUUID")):
                try:
                    facts[key] = _text(getattr(nv, fn)(h))
                except Exception:
                    pass
            try:
                facts["pci_bus_id"] = normalize_bus_id(_text(nv.nvmlDeviceGetPciInfo(h).busId))
            except Exception:
                pass
            try:
                facts["driver"] = _text(nv.nvmlSystemGetDriverVersion())
            except Exception:
                pass
            try:
                facts["total_memory"] = int(nv.nvmlDeviceGetMemoryInfo(h).total)
            except Exception:
                pass
            for key, fn in (("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                            ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                            ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                            ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
                try:
                    facts[key] = int(getattr(nv, fn)(h))
                except Exception:
                    pass
            try:
                facts["numa_node"] = int(nv.nvmlDeviceGetNumaNodeId(h))
            except Exception:
                pass
    if "pci_bus_id" not in facts:
        if isinstance(device, str) and not device.startswith(("GPU-", "MIG-")):
            facts["pci_bus_id"] = normalize_bus_id(device)
        elif isinstance(device, int) and query_cuda:
            dev = _cuda_bus_id(device)
            if dev:
                facts.setdefault("name", dev.get("name"))
                facts.setdefault("uuid", dev.get("uuid"))
                facts.setdefault("total_memory", dev.get("total_memory"))
                facts["pci_bus_id"] = normalize_bus_id(dev["pci_bus_id"])
    bus = facts.get("pci_bus_id")
    if bus and "numa_node" not in facts:
        node = _read(_sysfs_device(bus, sysfs_root) / "numa_node")
        if node is not None and node.lstrip("-").isdigit():
            facts["numa_node"] = int(node)
    if bus and not (set(facts) - {"pci_bus_id"}) and not _sysfs_device(bus, sysfs_root).exists():
        return {}  # a bus id we were given, nothing behind it
    return {k: v for k, v in facts.items() if v is not None}


def numa_cpus_for_device(device, sysfs_root: str = "/sys", query_cuda: bool = True):
    """CPUs close to the GPU (NVML CPU affinity, else sysfs local_cpulist); None when unknown."""
    nv = _nvml()
    if nv is not None:
        h = _nvml_handle(nv, device)
        if h is not None:
            try:
                words = nv.nvmlDeviceGetCpuAffinity(h, (os.cpu_count() + 63) // 64)
                cpus = {w * 64 + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1}
                if cpus:
                    return cpus
            except Exception:
                pass
    if isinstance(device, str) and not device.startswith(("GPU-", "MIG-")):
        bus = normalize_bus_id(device)
    else:
        facts = device_facts(device, sysfs_root, query_cuda=query_cuda)
        bus = facts.get("pci_bus_id")
    if not bus:
        return None
    text = _read(_sysfs_device(bus, sysfs_root) / "local_cpulist")
    if text:
        cpus = parse_cpulist(text)
        return cpus or None
    return None


def pin_writer_near(device, sysfs_root: str = "/sys"):
    """Pin the calling process (the writer) to the CPUs near ``device``, only on multi-node hosts.

    ``device``: preferably the PCI bus id the serving process found (``device_facts()["pci_bus_id"]``);
    an ordinal works only through NVML (the writer never initializes CUDA). Returns the CPU set
    applied, or None when nothing was done (one NUMA node, unknown placement, or no overlap with
    the CPUs this process may use). Never raises.
    """
    try:
        if numa_node_count(sysfs_root) <= 1:
            return None
        cpus = numa_cpus_for_device(device, sysfs_root, query_cuda=False)
        if not cpus:
            return None
        allowed = os.sched_getaffinity(0)
        target = cpus & allowed
        if not target or target == allowed:
            return None
        os.sched_setaffinity(0, target)
        log.info("fastdump: writer pinned to CPUs %s near GPU %s", _cpulist(target), device)
        return target
    except Exception as exc:
        log.debug("fastdump: writer not pinned: %s", exc)
        return None


def _cpulist(cpus) -> str:
    cpus = sorted(cpus)
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
