"""Inventory: simulated lists and NVML (through a fake NVML module: there is no GPU here)."""

import re

import pytest

from spawner.policy.placement import Gpu
from spawner.spawners.inventory import InventoryError, nvml_gpus, parse_simulated


def test_parse_simulated():
    gpus = parse_simulated(
        [
            {"node": "a", "count": 2, "model": "A100", "memory_mib": 40960},
            {"node": "b", "count": 1, "first_index": 4},
        ]
    )
    assert [(g.label, g.model, g.memory_mib) for g in gpus] == [
        ("a:0", "A100", 40960),
        ("a:1", "A100", 40960),
        ("b:4", "Simulated GPU", None),
    ]


@pytest.mark.parametrize(
    "entries, words",
    [
        ([{"count": -1}], "whole number >= 0"),
        ([{"count": "4"}], "whole number >= 0"),
        ([{"count": 1, "gpus": 4}], "unknown keys ['gpus']"),
        ([{"node": "a", "count": 1}, {"node": "a", "count": 1}], "a:0 appears twice"),
    ],
)
def test_parse_simulated_refuses(entries, words):
    with pytest.raises(InventoryError) as err:
        parse_simulated(entries)
    assert words in str(err.value)


class FakeNVML:
    class NVMLError(Exception):
        pass

    def __init__(self, names=None, fail=False):
        self.names, self.fail, self.shutdown = names or [], fail, False

    def nvmlInit(self):
        if self.fail:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.names[h].encode()  # older bindings return bytes

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:04d}"

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": 80 * 1024**3})()


def test_nvml_gpus_reads_every_device():
    nvml = FakeNVML(["NVIDIA H100", "NVIDIA H100"])
    assert nvml_gpus("srv", nvml=nvml) == (
        Gpu("srv", 0, "NVIDIA H100", 81920, "GPU-0000"),
        Gpu("srv", 1, "NVIDIA H100", 81920, "GPU-0001"),
    )
    assert nvml.shutdown


def test_nvml_without_a_driver_says_what_to_configure():
    with pytest.raises(InventoryError, match=re.escape("c.GpuHub.inventory = 'simulated'")):
        nvml_gpus("srv", nvml=FakeNVML(fail=True))


def test_real_nvml_on_this_machine_is_either_gpus_or_that_message():
    try:
        gpus = nvml_gpus("here")
    except InventoryError as e:
        assert "no NVIDIA driver" in str(e)
    else:
        assert gpus and all(g.uuid and g.memory_mib for g in gpus)
