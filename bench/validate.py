"""The KV model checked against what real engines allocate, to the byte where they report bytes.

- llama.cpp: the KV buffer its log reports (MiB, two decimals) for several cache types, context sizes
  and slot counts, against ``engine_kv(..., "llamacpp")``.
- vLLM: bytes per block. vLLM sizes its pool as ``budget // bytes_per_block``, so two starts, with a
  budget of exactly K predicted blocks and with one byte less, give K and K - 1 blocks only if vLLM's
  bytes per block equal the prediction exactly. Done for two dtypes.
- transformers: the cache tensors' bytes after a generate call, for the embedded model and for a small
  randomly initialised hybrid sliding-window model (Gemma 3 layout), against ``engine_kv(..., "hf")``.

Each check is a row: predicted, engine-reported, measured, error %.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbench.backends import REGISTRY
from kvbench.backends.types import EngineStartError, ServerSpec
from kvbench.envs import env_python
from kvbench.kvmodel import engine_kv, geometry_from_hf_config, kv_bytes_per_token
from kvbench.models import ModelFiles

MIB = 2**20
PROBE = Path(__file__).resolve().parent.parent / "backends" / "scripts" / "hf_kv_probe.py"
# A Gemma-3-shaped hybrid model small enough to build at random: 5 sliding layers (window 16) + 1 full.
HYBRID_CONFIG = {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                 "sliding_window": 16, "sliding_window_pattern": 6, "max_position_embeddings": 1024}


@dataclass
class Check:
    engine: str
    case: str
    quantity: str
    predicted: float
    engine_reported: float | None
    measured: float | None
    tolerance: float  # bytes: what the engine's rounding allows
    note: str = ""

    @property
    def observed(self) -> float | None:
        return self.measured if self.measured is not None else self.engine_reported

    @property
    def error_pct(self) -> float | None:
        if self.observed is None or not self.predicted:
            return None
        return (self.observed - self.predicted) / self.predicted * 100

    @property
    def ok(self) -> bool:
        return self.observed is not None and abs(self.observed - self.predicted) <= self.tolerance

    def row(self) -> dict:
        return {**asdict(self), "error_pct": self.error_pct, "ok": self.ok}


def _start(engine: str, env: Path, spec: ServerSpec, log_dir: Path, name: str, options: dict | None = None):
    backend = REGISTRY[engine](REGISTRY[engine].default_version, env, options)
    backend.start(spec, log_dir / f"{name}.log", timeout_s=300)
    return backend


def check_llamacpp(env: Path, model: ModelFiles, log_dir: Path,
                   cases=(("f16", 512, 1), ("f16", 4096, 2), ("q8_0", 1000, 1), ("q8_0", 4096, 1),
                          ("q4_0", 2048, 1), ("q4_0", 8192, 1))) -> list[Check]:
    checks = []
    for cache_type, context, slots in cases:
        spec = ServerSpec(model=model, max_context=context, max_concurrency=slots, kv_dtype=cache_type)
        name = f"llamacpp-{cache_type}-{context}x{slots}"
        backend = _start("llamacpp", env, spec, log_dir, name)
        try:
            pool = backend.kv_pool()
        finally:
            backend.stop()
        predicted = engine_kv(model.geometry, cache_type, context, slots, "llamacpp").bytes_per_rank
        n_caches = len(pool.details["caches"]) if pool else 1
        checks.append(Check("llamacpp", f"{cache_type}, {slots} slot(s) x {context} tokens", "KV buffer bytes",
                            predicted, pool.bytes if pool else None, None, tolerance=(0.005 * MIB + 1) * n_caches,
                            note="log gives MiB to 2 decimals" if pool else "no llama_kv_cache line in the log"))
    return checks


def check_vllm(env: Path, model: ModelFiles, log_dir: Path, dtypes=("bf16", "fp32"), blocks: int = 8) -> list[Check]:
    checks = []
    block = 128  # vLLM's CPU default; on a GPU it would be 16
    for dtype in dtypes:
        per_block = int(block * kv_bytes_per_token(model.geometry, dtype))
        counts = []
        for budget in (blocks * per_block, blocks * per_block - 1):
            spec = ServerSpec(model=model, max_context=256, max_concurrency=1, kv_dtype=dtype)
            backend = _start("vllm", env, spec, log_dir, f"vllm-{dtype}-{budget}", {"kv_cache_memory_bytes": budget})
            try:
                pool = backend.kv_pool()
            finally:
                backend.stop()
            counts.append(pool.details["num_gpu_blocks"] if pool else None)
        exact = counts == [blocks, blocks - 1]
        reported = per_block if exact else (blocks * per_block / counts[0] if counts[0] else None)
        checks.append(Check("vllm", f"{dtype}, budget {blocks} blocks and 1 byte less", "bytes per block",
                            per_block, reported, None, tolerance=0,
                            note=f"num_gpu_blocks {counts[0]} then {counts[1]}"
                                 + ("" if exact else ": bytes per block differ from the formula")))
    return checks


def _probe(hf_python: Path, args: list[str]) -> dict:
    out = subprocess.run([str(hf_python), str(PROBE), *args], capture_output=True, text=True, timeout=600,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    if out.returncode != 0:
        raise RuntimeError(f"hf probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_hf(env: Path, model: ModelFiles) -> list[Check]:
    hf_python = env_python(env)
    checks = []
    for dtype, prompt, new, batch in (("bf16", 300, 8, 2), ("fp32", 100, 4, 1)):
        got = _probe(hf_python, ["--model", str(model.hf_dir), "--prompt", str(prompt), "--new", str(new),
                                 "--batch", str(batch), "--dtype", dtype])
        predicted = engine_kv(model.geometry, dtype, prompt + new - 1, batch, "hf").bytes_per_rank
        checks.append(Check("hf", f"{model.name} {dtype}, {batch} x ({prompt} + {new})", "cache tensor bytes",
                            predicted, None, got["cache_bytes"], tolerance=0, note=f"transformers {got['transformers']}"))
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(json.dumps(HYBRID_CONFIG))
        geom = geometry_from_hf_config(HYBRID_CONFIG)
        for prompt, new in ((10, 3), (200, 6)):
            got = _probe(hf_python, ["--config", str(config_file), "--prompt", str(prompt), "--new", str(new),
                                     "--batch", "2", "--dtype", "bf16"])
            predicted = engine_kv(geom, "bf16", prompt + new - 1, 2, "hf").bytes_per_rank
            checks.append(Check("hf", f"hybrid sliding (window 16, 5 of 6 layers), 2 x ({prompt} + {new})",
                                "cache tensor bytes", predicted, None, got["cache_bytes"], tolerance=0,
                                note=f"layer lengths {got['layer_lengths']}"))
    return checks


def markdown(checks: list[dict]) -> str:
    def fmt(x):
        return "-" if x is None else f"{x:,.0f}"
    lines = ["| engine | case | quantity | predicted | engine-reported | measured | error % | within engine rounding |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for c in checks:
        err = "-" if c["error_pct"] is None else f"{c['error_pct']:+.4f}"
        lines.append(f"| {c['engine']} | {c['case']} | {c['quantity']} | {fmt(c['predicted'])} "
                     f"| {fmt(c['engine_reported'])} | {fmt(c['measured'])} | {err} "
                     f"| {'yes' if c['ok'] else 'NO'} {('(' + c['note'] + ')') if c['note'] else ''} |")
    return "\n".join(lines)


def run_all(envs: dict[str, Path], model: ModelFiles, log_dir: Path, log=print) -> list[dict]:
    """Every check for the engines in ``envs``; an engine that fails becomes one failed row."""
    log_dir.mkdir(parents=True, exist_ok=True)
    steps = {"llamacpp": lambda e: check_llamacpp(e, model, log_dir), "vllm": lambda e: check_vllm(e, model, log_dir),
             "hf": lambda e: check_hf(e, model)}
    rows = []
    for engine, env in envs.items():
        log(f"validating the KV model against {engine}")
        try:
            rows += [c.row() for c in steps[engine](env)]
        except (EngineStartError, RuntimeError, subprocess.TimeoutExpired) as exc:
            rows.append({"engine": engine, "case": "all", "quantity": "-", "predicted": None, "engine_reported": None,
                         "measured": None, "tolerance": 0, "note": f"failed: {exc}", "error_pct": None, "ok": False})
    return rows
