"""(b) transformers on CUDA: the KV cache of one ``generate`` call measured three ways (the cache tensors' bytes,
the CUDA allocator's delta, NVML's device delta) at several prompt lengths and batches, against the
transformers engine's KV rules; on the embedded model, each ``--model`` HF folder, random-weight models of
real configs (built on the GPU: no model file has to travel) and, with ``--families``, kvbench validate's
families."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvbench.kv.units import fmt_bytes
from kvbench.selfcheck.engines import TRANSFORMERS

from .common import (ALLOCATOR_ABS, ALLOCATOR_REL, NVML_ABS, NVML_REL, ROOT, Budget, embedded_hf_dir, fmt_ok,
                     fmt_ratio, ratio, within)
from .overhead import overhead_row
from .probe import Probe, nvml_snapshot

# (prompt tokens, batch) for transformers on CUDA; cells longer than the model's context are dropped.
KV_CELLS = [(1024, 1), (4096, 1), (4096, 4), (16384, 1), (32768, 1), ("max", 1), ("max", 8)]
# random-weight models of real configs: past Gemma 3's window (1024) and Mistral's (4096), within minutes
CONFIG_CELLS = [(1024, 1), (8192, 1), (4096, 4)]
FAMILY_CELLS = [(100, 2), (1000, 1)]  # the validation families: windows and chunks of 64
NEW_TOKENS = 16
# (b) without --config: random-weight models of three real geometries, built on the GPU from their configs
# (no model files travel): an 8B GQA model, a hybrid sliding-window model (5 local : 1 global layers) and an
# MLA model (the latent cached, K only). The H200 run of 2026-11-30 built these three among five in 271 s.
CONFIG_DIR = ROOT / "tests" / "data" / "configs"
DEFAULT_CONFIGS = ("llama-3.1-8b.json", "gemma-3-4b-it.json", "deepseek-v2-lite.json")


def kv_row(model: str, predicted: float, before: dict, after: dict, snap_before: dict, snap_after: dict) -> dict:
    """Check (b), one cell: the three measurements of one generate call's KV cache against the model."""
    allocator = after["allocated"] - before["allocated"]
    nvml = snap_after["device_used"] - snap_before["device_used"]
    pb, pa = snap_before.get("process_bytes"), snap_after.get("process_bytes")
    return {"model": model, "prompt_tokens": after["prompt"], "batch": after["batch"], "new_tokens": after["new"],
            "predicted_bytes": predicted, "cache_bytes": after["cache_bytes"], "allocator_delta_bytes": allocator,
            "allocator_peak_delta_bytes": after["max_allocated"] - before["allocated"],
            "nvml_device_delta_bytes": nvml, "nvml_process_delta_bytes": pa - pb if None not in (pa, pb) else None,
            "generate_s": after.get("seconds"),
            "cache_over_predicted": ratio(after["cache_bytes"], predicted),
            "allocator_over_cache": ratio(allocator, after["cache_bytes"]),
            "nvml_over_cache": ratio(nvml, after["cache_bytes"]),
            "cache_ok": after["cache_bytes"] == round(predicted),
            "allocator_ok": within(allocator, after["cache_bytes"], ALLOCATOR_REL, ALLOCATOR_ABS),
            "nvml_ok": within(nvml, after["cache_bytes"], NVML_REL, NVML_ABS)}


def kv_cells(max_context: int | None, new_tokens: int = NEW_TOKENS) -> list[tuple[int, int]]:
    """The (prompt, batch) cells that fit the model's context, in order, without duplicates."""
    limit = (max_context or 2048) - new_tokens
    out = []
    for prompt, batch in KV_CELLS:
        p = limit if prompt == "max" else prompt
        if p <= limit and (p, batch) not in out:
            out.append((p, batch))
    return out


def check_kv(nvml, python: str, model_dir: Path, name: str, budget: Budget, logs: Path,
             script: Path | None = None, cells: list[tuple[int, int]] | None = None,
             overhead: list[dict] | None = None) -> list[dict]:
    """(b) for one model: a folder with weights, or a config.json file (a random-weight model built on the GPU)."""
    from kvbench.backends import kv_rules
    from kvbench.kv.model_config import geometry_from_hf
    from kvbench.kv.rules import KVQuestion

    geom = geometry_from_hf(model_dir)
    limit = (geom.max_context or 2048) - NEW_TOKENS
    cells = [(p, b) for p, b in cells if p <= limit] if cells else kv_cells(geom.max_context)
    # the probe runs in its own folder: the path must not be relative
    source = ["--config" if model_dir.is_file() else "--model", str(model_dir.resolve())]
    idle = nvml_snapshot(nvml, set(), settle_s=0.0)  # before the probe: no CUDA context of it yet
    probe = Probe(python, ["kv", *source, "--cells", ",".join(f"{p}x{b}" for p, b in cells),
                           "--new", str(NEW_TOKENS)], logs / f"probe_kv_{name}.log", script)
    rows = []
    try:
        pids = {probe.proc.pid}
        probe.next(min(120, budget.left()))  # ready
        ready = nvml_snapshot(nvml, pids)
        probe.go()
        loaded_event = probe.next(min(300, budget.left()))  # loaded
        loaded = nvml_snapshot(nvml, pids)
        probe.go()
        for prompt, batch in cells:
            if budget.left() < 30:
                rows.append({"model": name, "prompt_tokens": prompt, "batch": batch, "error": "skipped: time budget"})
                continue
            question = KVQuestion(geom, "bf16", prompt + NEW_TOKENS - 1, batch)
            predicted = kv_rules(TRANSFORMERS).answer(question).bytes_per_gpu
            before = probe.next(60)
            snap_before = nvml_snapshot(nvml, pids)
            probe.go()
            after = before if before["event"] == "cell_error" else probe.next(max(10, budget.left() - 20))
            if after["event"] == "cell_error":
                rows.append({"model": name, "prompt_tokens": prompt, "batch": batch, "predicted_bytes": predicted,
                             "error": after["error"]})
                probe.go()
                continue
            snap_after = nvml_snapshot(nvml, pids)
            rows.append(kv_row(name, predicted, before, after, snap_before, snap_after))
            probe.go()
            probe.next(60)  # cell_freed
            probe.go()
        if overhead is not None:
            overhead.append(overhead_row(name, idle, ready, loaded_event, loaded, rows))
    except (TimeoutError, RuntimeError) as exc:
        rows.append({"model": name, "prompt_tokens": "-", "batch": "-", "error": str(exc)})
    finally:
        probe.close()
    return rows


def run_kv(result: dict, nvml, python: str, budget: Budget, out: Path, save: Callable[[], None], *,
           embedded: bool, models: list[str], configs: list[Path], families: bool) -> None:
    """(b) on every model asked for, each within what is left of the budget; ``save`` after each."""
    from kvbench.common.models import ModelError

    targets = []
    if embedded:
        try:
            targets.append(("smollm2", embedded_hf_dir(python), None))
        except ModelError as exc:
            result["skipped"].append(f"(b) smollm2: {exc}")
    targets += [(Path(m).name, Path(m), None) for m in models]
    targets += [(c.stem, c, CONFIG_CELLS) for c in configs]
    if families:
        from kvbench.run.validate import families as validation_families

        folder = out / "configs"
        folder.mkdir(exist_ok=True)
        for f in validation_families():
            (folder / f"{f.name}.json").write_text(json.dumps(f.config))
            targets.append((f.name, folder / f"{f.name}.json", FAMILY_CELLS))
    for name, source, cells in targets:
        if budget.left() < 60:
            result["skipped"].append(f"(b) {name}: time budget")
            continue
        print(f"(b) transformers on CUDA: {name}", flush=True)
        try:
            result.setdefault("kv", []).extend(check_kv(nvml, python, source, name, budget, out / "logs",
                                                        cells=cells, overhead=result.setdefault("overhead", [])))
        except (TimeoutError, RuntimeError) as exc:  # one model that will not load is its own row
            result.setdefault("kv", []).append({"model": name, "prompt_tokens": "-", "batch": "-",
                                                "error": str(exc)})
        save()


def problems(result: dict) -> list[str]:
    out = []
    if not result.get("kv"):
        out.append("(b) no transformers KV measurement on CUDA")
    for r in result.get("kv", []):
        if "error" in r:
            out.append(f"(b) {r['model']} {r['prompt_tokens']} x{r['batch']}: {r['error']}")
            continue
        for key in ("cache_ok", "allocator_ok", "nvml_ok"):
            if r.get(key) is False:
                out.append(f"(b) {r['model']} {r['prompt_tokens']} x{r['batch']}: {key[:-3]} disagrees")
    return out


def markdown(result: dict) -> list[str]:
    lines = ["## (b) transformers on CUDA: the KV cache three ways", "",
             f"One `generate` call per row ({NEW_TOKENS} new tokens): predicted = kvbench.kv.geometry (hf rules) for "
             "prompt + new - 1 tokens; cache = the cache tensors' numel x element_size; allocator = "
             "`torch.cuda.memory_allocated()` after - before (the cache is all that is left); NVML = device "
             "used after - before, with the allocator's cached blocks released on both sides.", "",
             "| model | prompt | batch | predicted | cache tensors | allocator delta | NVML delta | "
             "cache / predicted | allocator / cache | NVML / cache | allocator peak delta | agrees |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result.get("kv", []):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['prompt_tokens']} | {r['batch']} | {fmt_bytes(r.get('predicted_bytes'))} "
                         f"| {r['error']} | | | | | | | **no** |")
            continue
        lines.append(f"| {r['model']} | {r['prompt_tokens']} | {r['batch']} | {fmt_bytes(r['predicted_bytes'])} "
                     f"| {fmt_bytes(r['cache_bytes'])} | {fmt_bytes(r['allocator_delta_bytes'])} "
                     f"| {fmt_bytes(r['nvml_device_delta_bytes'])} | {fmt_ratio(r['cache_over_predicted'])} "
                     f"| {fmt_ratio(r['allocator_over_cache'])} | {fmt_ratio(r['nvml_over_cache'])} "
                     f"| {fmt_bytes(r['allocator_peak_delta_bytes'])} | cache {fmt_ok(r['cache_ok'])}, allocator "
                     f"{fmt_ok(r['allocator_ok'])}, NVML {fmt_ok(r['nvml_ok'])} |")
    return lines
