"""Synthetic runs for the report/compare tests: real RunWriter folders with seeded numbers, no engine."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kvbench.store.schema import CellRow, RequestRow
from kvbench.store.writer import RunWriter

CONTRACT = "token ids, ignore_eos"


def make_run(root: Path, run_id: str, backends=(("vllm", "0.31.0"),), prompts=(1024, 2048), concurrency=(1, 4),
             repeats: int = 3, n_requests: int = 16, scale: dict | None = None, seed: int = 0,
             contract: str = CONTRACT, failed: set | None = None, noise: float = 0.02,
             reported: dict | None = None) -> Path:
    """A finished run. ``scale`` multiplies a backend's latencies ("latency"), throughput ("throughput")
    and KV bytes in use ("kv": its peak and timeline, the prediction kept, as an engine that rounds its
    blocks up differently) by a factor, e.g. {"vllm-0.32.0": {"latency": 1.10}}: a real 10 % regression.
    Repeats vary by ``noise`` (relative sd); every request has its own TTFT/ITL samples. KV in use is the
    same in every repeat (deterministic, as an engine's is). Each engine reports its version, unless
    ``reported`` maps its label to what it reports instead (None: nothing, as a server without /version)."""
    rng = np.random.default_rng(seed)
    scale = scale or {}
    failed = failed or set()
    writer = RunWriter(root / run_id)
    writer.write_run_info({"run_id": run_id, "status": "finished", "command": f"kvbench run (synthetic {run_id})",
                           "started_at": "2026-12-01T10:00:00+00:00",
                           "environment": {"cpu": "Synthetic CPU", "cpu_count": 2, "memory_bytes": 2**34, "gpus": []},
                           "model": {"name": "smollm2", "sha256": "ab" * 32, "max_context": 8192},
                           "engine_versions": {f"{e}-{v}": v for e, v in backends},
                           "workload": {"name": "smoke", "seed": 1, "description": "synthetic"}})
    for engine, version in backends:
        label = f"{engine}-{version}"
        lat = scale.get(label, {}).get("latency", 1.0)
        thr = scale.get(label, {}).get("throughput", 1.0)
        kv_scale = scale.get(label, {}).get("kv", 1.0)
        for p in prompts:
            for c in concurrency:
                for rep in range(repeats):
                    cid = f"{label}_p{p}_c{c}_r{rep}"
                    if (label, p, c) in failed:
                        writer.write_cell(CellRow(
                            run_id=run_id, cell_id=cid, backend=label, engine=engine, engine_version=version,
                            engine_version_reported=(reported or {}).get(label, version),
                            model="smollm2", workload="smoke", prompt_tokens=p, output_tokens=16, concurrency=c,
                            repeat=rep, kv_dtype="bf16", token_contract=contract, status="failed",
                            error="engine failed to start", log_tail="boom"))
                        continue
                    base_ttft = 0.001 * p * c * lat * (1 + noise * rng.standard_normal())
                    base_itl = 0.05 * c * lat * (1 + noise * rng.standard_normal())
                    t0 = 1000.0 * (rep + 1)
                    ttfts, tpots = [], []
                    for i in range(n_requests):
                        ttft = base_ttft * rng.lognormal(0, 0.05)
                        gaps = base_itl * rng.lognormal(0, 0.05, size=15)
                        sent = t0 + i * 0.01
                        times = list(sent + ttft + np.concatenate([[0], np.cumsum(gaps)]))
                        ttfts.append(ttft)
                        tpots.append((times[-1] - times[0]) / 15)
                        writer.write_request(RequestRow(
                            run_id=run_id, cell_id=cid, backend=label, request_id=f"r{i}", repeat=rep,
                            prompt_tokens_sent=p, prompt_tokens_reported=p, output_tokens_requested=16,
                            output_tokens_received=16, output_tokens_reported=16, t_sent=sent, t_done=times[-1],
                            chunk_times=times, chunk_tokens=[1] * 16, ttft_s=ttft, e2e_s=times[-1] - sent, error=None))
                    predicted = 23040.0 * c * (p + 15)
                    kv = predicted * kv_scale
                    writer.write_cell(CellRow(
                        run_id=run_id, cell_id=cid, backend=label, engine=engine, engine_version=version,
                        engine_version_reported=(reported or {}).get(label, version),
                        model="smollm2", workload="smoke", prompt_tokens=p, output_tokens=16, concurrency=c,
                        repeat=rep, kv_dtype="bf16", token_contract=contract, status="ok",
                        n_requests=n_requests, n_ok=n_requests,
                        ttft_s_p50=float(np.percentile(ttfts, 50)), ttft_s_p99=float(np.percentile(ttfts, 99)),
                        itl_s_p50=base_itl, itl_s_p99=base_itl * 1.2, tpot_s_p50=float(np.percentile(tpots, 50)),
                        e2e_s_p50=float(np.percentile(ttfts, 50)) + 15 * base_itl,
                        e2e_s_p99=float(np.percentile(ttfts, 99)) + 15 * base_itl,
                        output_tokens_per_s=100.0 / c * thr * (1 + noise * rng.standard_normal()),
                        total_tokens_per_s=1000.0 * thr * (1 + noise * rng.standard_normal()),
                        requests_per_s=1.0 * thr * (1 + noise * rng.standard_normal()),
                        kv_bytes_per_token_predicted=23040.0, kv_bytes_peak_predicted=predicted,
                        kv_in_use_peak_bytes=kv, kv_measured_over_predicted=kv / predicted,
                        kv_pool_bytes_engine=23040 * 32768,
                        kv_pool_tokens_engine=32768, rss_peak_bytes=int(2**30 * (1 + 0.01 * rng.standard_normal())),
                        t_cell_start=t0))
                    writer.write_timeline(cid, _timeline(kv))
    return writer.root


def _timeline(kv: float):
    import pandas as pd

    t = np.linspace(0, 2, 41)
    mem = pd.DataFrame({"t_s": t, "series": "memory", "rss_bytes": 2**30 + kv * t / 2})
    kvs = pd.DataFrame({"t_s": t, "series": "kv", "kv_bytes_in_use": kv * np.minimum(t, 1.0)})
    return pd.concat([mem, kvs], ignore_index=True)
