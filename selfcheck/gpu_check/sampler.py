"""(a) The NVML sampler against a real allocation of known size: a CUDA torch process allocates ``--alloc-gib``
GiB; the device and process deltas NVML reports, read at that moment and by the 20 Hz sampler, against the
bytes allocated."""
from __future__ import annotations

import time
from pathlib import Path

from kvbench.kv.units import fmt_bytes

from .common import NVML_ABS, NVML_REL, Budget, fmt_ok, within
from .probe import Probe, nvml_snapshot


def sampler_row(requested: int, events: dict, snaps: dict, sampled: dict) -> dict:
    """Check (a) from the probe's events (ready, allocated), NVML read at those moments, and the sampler's
    peaks. ``snaps[x]`` = {"device_used", "process_bytes"}; ``sampled`` = peaks over the hold."""
    device_delta = snaps["allocated"]["device_used"] - snaps["ready"]["device_used"]
    proc = [snaps[k].get("process_bytes") for k in ("ready", "allocated")]
    process_delta = proc[1] - proc[0] if None not in proc else None
    allocator_delta = events["allocated"]["allocated"] - events["ready"]["allocated"]
    sampled_device = sampled.get("device_over_ready")
    sampled_process = sampled.get("process_over_ready")
    return {"requested_bytes": requested, "allocator_delta_bytes": allocator_delta,
            "nvml_device_delta_bytes": device_delta, "nvml_process_delta_bytes": process_delta,
            "sampled_device_delta_bytes": sampled_device, "sampled_process_delta_bytes": sampled_process,
            "sampler_hz": sampled.get("hz"), "sampler_samples": sampled.get("samples"),
            "process_found": snaps["allocated"].get("process_found"),
            "device_ok": within(device_delta, requested, NVML_REL, NVML_ABS),
            "process_ok": within(process_delta, requested, NVML_REL, NVML_ABS),
            "sampled_ok": within(sampled_device, requested, NVML_REL, NVML_ABS),
            "rate_ok": sampled.get("hz") is not None and sampled["hz"] >= 19.0}


def check_sampler(nvml, python: str, alloc_bytes: int, budget: Budget, logs: Path,
                  script: Path | None = None) -> dict:
    from kvbench.run.samplers import ProcessTreeMemorySampler

    baseline = nvml.idle_baseline()
    probe = Probe(python, ["alloc", "--bytes", str(alloc_bytes)], logs / "probe_alloc.log", script)
    try:
        pids = {probe.proc.pid}
        sampler = ProcessTreeMemorySampler(probe.proc.pid, 20.0, nvml, baseline)
        sampler.start()
        events, snaps = {}, {}
        try:
            events["ready"] = probe.next(min(120, budget.left()))
            t_ready = time.perf_counter()
            snaps["ready"] = nvml_snapshot(nvml, pids)
            # the samples finished by now: one under way may read after go() though stamped before it (its
            # thread descheduled mid-read on busy cores), and would put the allocation in the baseline
            n_ready = len(sampler.samples)
            probe.go()
            events["allocated"] = probe.next(min(60, budget.left()))
            snaps["allocated"] = nvml_snapshot(nvml, pids)
            time.sleep(1.0)  # the sampler sees the allocation held for a second
        finally:
            sampler.stop()
        probe.go()
        events["freed"] = probe.next(30)
        snaps["freed"] = nvml_snapshot(nvml, pids)
    finally:
        probe.close()
    samples = sampler.samples
    # the ready baseline: the sampler's last reading between the probe's ready and go(), or, where its
    # thread got no turn then, NVML read at ready in this thread (never a sample from before the probe's
    # context existed)
    at_ready = [s for s in samples[:n_ready] if s.t >= t_ready]
    ready_dev = at_ready[-1].gpu_device_used_bytes if at_ready else snaps["ready"]["device_used"]
    ready_proc = at_ready[-1].gpu_process_bytes if at_ready else snaps["ready"]["process_bytes"]
    span = samples[-1].t - samples[0].t if len(samples) > 1 else 0
    dev = [s.gpu_device_used_bytes for s in samples if s.gpu_device_used_bytes is not None]
    proc = [s.gpu_process_bytes for s in samples if s.gpu_process_bytes is not None]
    sampled = {"hz": (len(samples) - 1) / span if span else None, "samples": len(samples),
               "device_over_ready": max(dev) - ready_dev if dev and ready_dev is not None else None,
               "process_over_ready": max(proc) - ready_proc if proc and ready_proc is not None else None}
    row = sampler_row(alloc_bytes, events, snaps, sampled)
    row["baseline"] = baseline.to_dict() if baseline else None
    row["freed_device_delta_bytes"] = snaps["freed"]["device_used"] - snaps["ready"]["device_used"]
    return row


def run_sampler(result: dict, nvml, python: str, alloc_bytes: int, budget: Budget, logs: Path) -> None:
    try:
        print("(a) NVML sampler against a real allocation", flush=True)
        result["sampler"] = check_sampler(nvml, python, alloc_bytes, budget, logs)
    except (TimeoutError, RuntimeError) as exc:
        result["skipped"].append(f"(a) failed: {exc}")


def problems(result: dict) -> list[str]:
    out = []
    s = result.get("sampler")
    if not s:
        out.append("(a) the NVML sampler check did not run")
    else:
        for key, what in (("device_ok", "NVML device delta"), ("sampled_ok", "sampled device delta"),
                          ("rate_ok", "sampler rate")):
            if s.get(key) is False:
                out.append(f"(a) {what} disagrees with the allocation")
    return out


def markdown(result: dict) -> list[str]:
    lines = ["## (a) NVML sampler against a real allocation", ""]
    s = result.get("sampler")
    if s:
        lines += ["| allocated | allocator delta | NVML device delta | NVML process delta | sampled device peak "
                  "| sampled process peak | sampler rate | agrees |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|",
                  f"| {fmt_bytes(s['requested_bytes'])} | {fmt_bytes(s['allocator_delta_bytes'])} "
                  f"| {fmt_bytes(s['nvml_device_delta_bytes'])} | {fmt_bytes(s['nvml_process_delta_bytes'])} "
                  f"| {fmt_bytes(s['sampled_device_delta_bytes'])} | {fmt_bytes(s['sampled_process_delta_bytes'])} "
                  f"| {s['sampler_hz'] or 0:.1f} Hz ({s['sampler_samples']}) "
                  f"| device {fmt_ok(s['device_ok'])}, sampled {fmt_ok(s['sampled_ok'])}, "
                  f"process {fmt_ok(s['process_ok'])}, rate {fmt_ok(s['rate_ok'])} |", ""]
        if not s.get("process_found"):
            lines += ["NVML did not list the allocating process's pid (a container with its own pid namespace "
                      "sees host pids): per-process figures are not attributable here; the device delta is.", ""]
    else:
        lines += ["not run", ""]
    return lines
