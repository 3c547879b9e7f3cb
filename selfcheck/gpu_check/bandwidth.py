"""(g) The decode bound's denominator on the GPU: the device read a GPU run records (the transformers
environment's ``gpu_probe.py bandwidth``, through the DeviceBandwidth capability, bench/run/device_bandwidth.py)
beside the card's specification (bench/planner/gpus.toml). A read is believable between half the specification
and the specification itself (copy kernels reach 80-93 % of it on data-centre cards; a read above it is a broken
probe, and one under half a card busy with something else or a wrong catalogue entry)."""
from __future__ import annotations

from pathlib import Path

from .common import fmt_ratio, ratio
from .probe import probe_script

LOW, HIGH = 0.5, 1.0  # the measured read over the specification a check accepts


def run_bandwidth(result: dict, nvml, python: str, budget) -> None:
    from kvbench.backends.capabilities import DeviceBandwidth
    from kvbench.run.device_bandwidth import card_bandwidth

    device = nvml.devices()[0]
    spec, source = card_bandwidth(device["name"], int(device["memory_bytes"]))
    measured = DeviceBandwidth(script=probe_script()).measure(Path(python), timeout_s=max(30.0, min(120.0, budget.left())))
    share = ratio(measured.get("read_bytes_per_s"), spec)
    result["bandwidth"] = {"gpu": device["name"], "spec_bytes_per_s": spec, "spec_source": source,
                           "measured": measured, "read_over_spec": share,
                           "ok": None if share is None else LOW <= share <= HIGH}


def problems(result: dict) -> list[str]:
    b = result.get("bandwidth")
    if b is None:
        return []
    if "not_measured" in b["measured"]:
        return [f"(g) the device read: {b['measured']['not_measured']}"]
    if b["ok"] is False:
        return [f"(g) the device read is {b['read_over_spec']:.2f} of the specification (expected {LOW}-{HIGH})"]
    return []


def markdown(result: dict) -> list[str]:
    b = result.get("bandwidth")
    lines = ["", "## (g) memory bandwidth: the device read a run divides by, beside the specification", "",
             f"`gpu_probe.py bandwidth` (a float32 sum and a copy of 2 GiB, best of 5 rounds of 10 passes), the read "
             f"over the card's specification (bench/planner/gpus.toml) expected between {LOW} and {HIGH}.", "",
             "| GPU | specification GB/s | read GB/s | copy GB/s | read / spec | ok |", "|---|---:|---:|---:|---:|---|"]
    if b is None:
        return lines + ["| not measured | | | | | |"]
    m = b["measured"]
    gbs = lambda v: "-" if not v else f"{v / 1e9:,.0f}"  # noqa: E731
    lines.append(f"| {b['gpu']} | {gbs(b['spec_bytes_per_s'])} | {gbs(m.get('read_bytes_per_s'))} | "
                 f"{gbs(m.get('copy_bytes_per_s'))} | {fmt_ratio(b['read_over_spec'])} | "
                 f"{ {True: 'yes', False: '**no**', None: '-'}[b['ok']]} |")
    return lines + ["", f"Specification: {b['spec_source']}"]
