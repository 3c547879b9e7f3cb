"""A stand-in for NVIDIA's DCGM exporter (dcgm-exporter): ``GET /metrics`` in the Prometheus text format
exactly as the exporter renders it (internal/pkg/rendermetrics/render_metrics.go): for each counter of
its default counters file (etc/default-counters.csv) a ``# HELP`` and a ``# TYPE`` line, then one sample
per GPU labelled ``gpu`` (index), ``UUID``, ``pci_bus_id``, ``device``, ``modelName`` and ``Hostname``
(released 4.x exporters; ``hostname`` after the 2026 rename: ``hostname_label``), plus the driver version
as a label when the counters file lists ``DCGM_FI_DRIVER_VERSION, label``. Framebuffer figures are whole
MiB. Served as ``text/plain; version=0.0.4; charset=utf-8``.

The values are the test's: ``set(gpu, fb_used=..., fb_free=..., fb_reserved=...)`` (MiB); or a function
of the scrape number, ``used_by_scrape[gpu] = lambda n: ...``. Every scrape is recorded in ``scrapes``
(``time.time()`` when it was served and the FB_USED value of each GPU), so a test can tell which values
fell inside a window."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tests.fakes._http import FakeServer, Handler

# (field, Prometheus type, help) in the order of dcgm-exporter's etc/default-counters.csv (the subset
# that a GPU without NVLink/vGPU reports; the memory counters are the ones kvbench reads)
COUNTERS = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB)."),
]


@dataclass
class GPU:
    index: int
    uuid: str
    pci_bus_id: str
    model_name: str = "NVIDIA H100 80GB HBM3"
    fb_used: int = 0  # MiB
    fb_free: int = 81_559
    fb_reserved: int = 520


class DCGMHandler(Handler):
    def do_GET(self):
        fake: FakeDCGMExporter = self.server.fake
        if self.path.split("?")[0] != "/metrics":
            return self.send_text(404, "404 page not found\n")
        self.send_text(200, fake.render(), "text/plain; version=0.0.4; charset=utf-8")


class FakeDCGMExporter(FakeServer):
    handler = DCGMHandler

    def __init__(self, gpus: list[GPU], hostname: str = "gpu-node-1", driver_version: str | None = "550.54.15",
                 hostname_label: str = "Hostname", host="127.0.0.1", port=0):
        super().__init__(host, port)
        self.gpus = {g.index: g for g in gpus}
        self.hostname, self.driver_version, self.hostname_label = hostname, driver_version, hostname_label
        self.used_by_scrape: dict[int, Callable[[int], int]] = {}
        self.scrapes: list[tuple[float, dict[int, int]]] = []
        self._n = 0

    def set(self, gpu: int, **mib) -> None:
        with self.lock:
            for key, value in mib.items():
                setattr(self.gpus[gpu], key, int(value))

    def _labels(self, g: GPU) -> str:
        labels = (f'gpu="{g.index}",UUID="{g.uuid}",pci_bus_id="{g.pci_bus_id}",device="nvidia{g.index}",'
                  f'modelName="{g.model_name}",{self.hostname_label}="{self.hostname}"')
        if self.driver_version:
            labels += f',DCGM_FI_DRIVER_VERSION="{self.driver_version}"'
        return labels

    def render(self) -> str:
        with self.lock:
            n, self._n = self._n, self._n + 1
            for index, used in self.used_by_scrape.items():
                self.gpus[index].fb_used = int(used(n))
            self.scrapes.append((time.time(), {i: g.fb_used for i, g in self.gpus.items()}))
            gpus = [GPU(**vars(g)) for g in self.gpus.values()]
        values = {
            "DCGM_FI_DEV_SM_CLOCK": lambda g: 1980, "DCGM_FI_DEV_MEM_CLOCK": lambda g: 2619,
            "DCGM_FI_DEV_MEMORY_TEMP": lambda g: 38, "DCGM_FI_DEV_GPU_TEMP": lambda g: 41,
            "DCGM_FI_DEV_POWER_USAGE": lambda g: "118.362000",
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": lambda g: 319159391 + n * 1000,
            "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": lambda g: 0, "DCGM_FI_DEV_GPU_UTIL": lambda g: 37,
            "DCGM_FI_DEV_MEM_COPY_UTIL": lambda g: 12, "DCGM_FI_DEV_ENC_UTIL": lambda g: 0,
            "DCGM_FI_DEV_DEC_UTIL": lambda g: 0, "DCGM_FI_DEV_XID_ERRORS": lambda g: 0,
            "DCGM_FI_DEV_FB_FREE": lambda g: g.fb_free, "DCGM_FI_DEV_FB_USED": lambda g: g.fb_used,
            "DCGM_FI_DEV_FB_RESERVED": lambda g: g.fb_reserved,
        }
        lines = []
        for name, kind, help_text in COUNTERS:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{self._labels(g)}}} {values[name](g)}" for g in gpus]
        return "\n".join(lines) + "\n"


def main() -> None:  # pragma: no cover - for trying it by hand: python -m tests.fakes.dcgm_exporter 9400
    import sys

    fake = FakeDCGMExporter([GPU(0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", "00000000:3B:00.0", fb_used=4845)],
                            port=int(sys.argv[1]) if len(sys.argv) > 1 else 9400)
    fake.serve_forever()


if __name__ == "__main__":
    main()
