"""fastdump.devices on CPU: cpulist parsing, a fake sysfs, a fake NVML, and graceful degradation."""

from __future__ import annotations

import os
import sys
import types

import pytest

from fastdump import devices


@pytest.fixture(autouse=True)
def fresh_nvml(monkeypatch):
    """Each test decides what NVML looks like; by default it is not installed."""
    monkeypatch.setitem(devices._nvml_state, "tried", False)
    monkeypatch.setitem(devices._nvml_state, "module", None)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    yield


def fake_sysfs(root, nodes=2, gpus=None):
    """<root>/devices/system/node/node{i} and <root>/bus/pci/devices/<bus>/{numa_node,local_cpulist}."""
    for i in range(nodes):
        (root / "devices" / "system" / "node" / f"node{i}").mkdir(parents=True)
    (root / "devices" / "system" / "node" / "possible").write_text(f"0-{nodes - 1}\n")
    for bus, (node, cpus) in (gpus or {}).items():
        d = root / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
        (d / "local_cpulist").write_text(cpus + "\n")
    return str(root)


@pytest.mark.parametrize("text,cpus", [
    ("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}),
    ("5", {5}),
    ("", set()),
    ("0-7:2", {0, 2, 4, 6}),
    (" 1 , 3-4 ", {1, 3, 4}),
])
def test_parse_cpulist(text, cpus):
    assert devices.parse_cpulist(text) == cpus


@pytest.mark.parametrize("raw,norm", [
    ("00000000:3B:00.0", "0000:3b:00.0"),
    ("0000:3b:00.0", "0000:3b:00.0"),
    ("00010000:E1:00.0", "10000:e1:00.0"),
    (b"00000000:1A:00.0", "0000:1a:00.0"),
    ("3b:00.0", "0000:3b:00.0"),
])
def test_normalize_bus_id(raw, norm):
    assert devices.normalize_bus_id(raw) == norm


def test_without_nvml_or_gpu_everything_degrades(tmp_path, monkeypatch):
    root = fake_sysfs(tmp_path, nodes=1)
    monkeypatch.setattr(devices, "_cuda_bus_id", lambda index: None)  # no CUDA device here
    assert devices._nvml() is None and "pynvml" in devices._nvml_state["error"]
    assert devices.device_facts(0, sysfs_root=root) == {}
    assert devices.device_facts("GPU-0123", sysfs_root=root) == {}
    assert devices.device_facts("0000:99:00.0", sysfs_root=root) == {}
    assert devices.numa_cpus_for_device(0, sysfs_root=root) is None
    assert devices.pin_writer_near(0, sysfs_root=root) is None
    assert devices.numa_node_count(str(tmp_path / "missing")) == 1


def test_sysfs_local_cpulist_and_numa_node(tmp_path):
    root = fake_sysfs(tmp_path, nodes=2, gpus={"0000:3b:00.0": (1, "16-31,48-63")})
    facts = devices.device_facts("00000000:3B:00.0", sysfs_root=root)
    assert facts == {"pci_bus_id": "0000:3b:00.0", "numa_node": 1}
    assert devices.numa_cpus_for_device("0000:3B:00.0", sysfs_root=root) == set(range(16, 32)) | set(range(48, 64))
    assert devices.numa_node_count(root) == 2


def test_ordinal_resolved_through_fastdumps_cuda_query(tmp_path, monkeypatch):
    root = fake_sysfs(tmp_path, nodes=2, gpus={"0000:1a:00.0": (0, "0-7")})
    monkeypatch.setattr(devices, "_cuda_bus_id", lambda index: {
        "index": 0, "name": "NVIDIA H200", "uuid": "GPU-abc", "pci_bus_id": "0000:1A:00.0",
        "total_memory": 1 << 30} if index == 0 else None)
    facts = devices.device_facts(0, sysfs_root=root)
    assert facts["name"] == "NVIDIA H200" and facts["pci_bus_id"] == "0000:1a:00.0" and facts["numa_node"] == 0
    assert devices.numa_cpus_for_device(0, sysfs_root=root) == set(range(8))
    # The writer never asks CUDA: an ordinal without NVML gives no placement there.
    assert devices.numa_cpus_for_device(0, sysfs_root=root, query_cuda=False) is None


def test_pin_writer_near_only_on_multi_node_hosts(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(set(cpus)))
    one = fake_sysfs(tmp_path / "one", nodes=1, gpus={"0000:3b:00.0": (0, "0-15")})
    assert devices.pin_writer_near("0000:3b:00.0", sysfs_root=one) is None and calls == []
    two = fake_sysfs(tmp_path / "two", nodes=2, gpus={"0000:3b:00.0": (1, "32-47,96-111")})
    assert devices.pin_writer_near("0000:3b:00.0", sysfs_root=two) == set(range(32, 48))  # & allowed
    assert calls == [set(range(32, 48))]


def test_pin_writer_near_leaves_affinity_when_no_overlap(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(cpus))
    two = fake_sysfs(tmp_path, nodes=2, gpus={"0000:3b:00.0": (1, "32-47")})
    assert devices.pin_writer_near("0000:3b:00.0", sysfs_root=two) is None and calls == []


def test_pin_writer_near_never_raises(tmp_path, monkeypatch):
    def boom(*a):
        raise PermissionError("not allowed")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(os, "sched_setaffinity", boom)
    two = fake_sysfs(tmp_path, nodes=2, gpus={"0000:3b:00.0": (1, "32-47")})
    assert devices.pin_writer_near("0000:3b:00.0", sysfs_root=two) is None


class FakeNVML(types.ModuleType):
    """Enough of pynvml for device_facts / numa_cpus_for_device."""

    def __init__(self):
        super().__init__("pynvml")
        self.inited = False

    def nvmlInit(self):
        self.inited = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("h", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for i in range(2):
            if self.nvmlDeviceGetUUID(("h", i)) == uuid:
                return ("h", i)
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        for i in range(2):
            if devices.normalize_bus_id(self.nvmlDeviceGetPciInfo(("h", i)).busId) == devices.normalize_bus_id(bus):
                return ("h", i)
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-0000000{h[1]}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=f"00000000:{0x3b + h[1] * 0x40:02X}:00.0".encode())

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=150754820096)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetNumaNodeId(self, h):
        return h[1]

    def nvmlDeviceGetCpuAffinity(self, h, words):
        # GPU 0: CPUs 0-31; GPU 1: CPUs 64-95 (second 64-bit word)
        return [0xFFFFFFFF, 0] if h[1] == 0 else [0, 0xFFFFFFFF]


def test_with_nvml(monkeypatch):
    nv = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    facts = devices.device_facts(1)
    assert nv.inited
    assert facts == {"name": "NVIDIA H200", "uuid": "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd",
                     "pci_bus_id": "0000:7b:00.0", "driver": "580.159.04", "total_memory": 150754820096,
                     "pcie_gen": 5, "pcie_width": 16, "pcie_gen_max": 5, "pcie_width_max": 16, "numa_node": 1}
    assert devices.numa_cpus_for_device(0) == set(range(32))
    assert devices.numa_cpus_for_device("0000:7b:00.0") == set(range(64, 96))
    assert devices.device_facts("GPU-00000000-aaaa-bbbb-cccc-dddddddddddd")["pci_bus_id"] == "0000:3b:00.0"


def test_cuda_visible_devices_maps_ordinals(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert devices.device_facts(0)["pci_bus_id"] == "0000:7b:00.0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000")  # abbreviated UUID
    assert devices.device_facts(0)["pci_bus_id"] == "0000:3b:00.0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(devices, "_cuda_bus_id", lambda index: None)
    assert devices.device_facts(0) == {}
