"""The decode bound's denominator on a GPU machine (bench/common/bandwidth.py measures a CPU's): the card's
specification (bench/planner/gpus.toml, by the name and total NVML gives) and a read measured on the device by
an engine environment of the run that can (backends/capabilities.py DeviceBandwidth), both recorded in run.json's
``memory_bandwidth``; the measured figure divides where there is one, else the specification, and the row says
which (docs/metrics.md, "Decode bound")."""
from __future__ import annotations

from kvbench.run.backend_config import BackendConfig


def card_bandwidth(name: str, total_bytes: int) -> tuple[float | None, str]:
    """The specification's bandwidth (bytes/s, None: none) of the GPU NVML names ``name`` with ``total_bytes``,
    and where it was read."""
    from kvbench.planner import gpu_of_device
    from kvbench.planner.shared import gpu_specs

    card = gpu_specs().get(gpu_of_device(name, total_bytes))
    return card.bandwidth(name) if card else (None, f"{name or 'the GPU'} is not in kvbench's catalogue "
                                                    "(bench/planner/gpus.toml)")


def gpu_bandwidth(environment: dict, backends: list[BackendConfig]) -> dict:
    """run.json's ``memory_bandwidth`` on a GPU machine: per GPU, of the first GPU NVML lists."""
    first = (environment.get("gpus") or [{}])[0]
    name = str(first.get("name") or "")
    spec, source = card_bandwidth(name, int(first.get("memory_bytes") or 0))
    measured = measure_on_device(backends)
    record = {"device": "gpu", "gpu": name, "spec_bytes_per_s": spec, "spec_source": source, "measured": measured}
    if measured.get("read_bytes_per_s"):
        record.update(bytes_per_s=measured["read_bytes_per_s"],
                      label=f"per GPU, read on the device at the run's start ({measured['engine']}'s torch)")
    elif spec:
        record.update(bytes_per_s=spec, label=f"per GPU, the card's specification; not measured: {measured['not_measured']}")
    else:
        record["not_measured"] = f"{source}; and not measured on the device: {measured['not_measured']}"
    return record


def measure_on_device(backends: list[BackendConfig]) -> dict:
    """The first device read an installed environment of the run's engines gives ({"not_measured": why} where
    none does). A run that attaches to a server reads nothing: the server holds the GPU, and the read's 4 GiB
    could take memory it allocates as it serves."""
    from kvbench.backends import REGISTRY
    from kvbench.common.envs import env_dir, env_python, is_installed

    if any(cfg.url or cfg.urls for cfg in backends):
        return {"not_measured": "the run attaches to a server on the GPU (a device read would take its memory)"}
    why = "no engine of the run measures a device bandwidth (backends/capabilities.py DeviceBandwidth)"
    for cfg in backends:
        cls = REGISTRY[cfg.engine]
        capability = cls.capabilities.device_bandwidth
        if capability.script is None:
            continue
        recipe = cls.recipe(cfg.version)
        if not is_installed(recipe):
            why = f"{cfg.engine}'s environment is not installed"
            continue
        figures = capability.measure(env_python(env_dir(recipe)))
        if "not_measured" not in figures:
            return {**figures, "engine": cfg.engine}
        why = f"{cfg.engine}: {figures['not_measured']}"
    return {"not_measured": why}
