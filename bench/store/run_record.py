"""What a run records per engine beside its rows (run.json): one object, written by one method.

Each field maps an engine's label (or its start's key, for several starts of one engine) to what the
runner learnt of it. ``--resume`` reads them back, so that an invocation adds to the earlier ones'.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from kvbench.store.readers import load_run_info
from kvbench.store.writer import RunWriter


@dataclass
class RunRecord:
    engine_versions: dict[str, str] = field(default_factory=dict)  # label -> the version the engine reported
    token_checks: dict[str, str] = field(default_factory=dict)  # label -> how its tokenizer was checked
    gpu_baselines: dict[str, dict | None] = field(default_factory=dict)  # label -> GPU memory before it started
    engine_stops: dict[str, dict] = field(default_factory=dict)  # start key -> why it stopped, survivors
    estimates: dict[str, dict] = field(default_factory=dict)  # start key -> estimated and taken seconds
    engine_threads: dict[str, dict] = field(default_factory=dict)  # start key -> the threads it computed on
    memory_walls: dict[str, dict] = field(default_factory=dict)  # start key -> its wall: limit, peak, OOM kills
    served_models: dict[str, list[str] | None] = field(default_factory=dict)  # label -> what the server serves
    capabilities: dict[str, dict] = field(default_factory=dict)  # label -> what an attached server supports
    engine_builds: dict[str, str] = field(default_factory=dict)  # label -> its build's per-machine choice
    replica_outages: dict[str, list[dict]] = field(default_factory=dict)  # start key -> replicas out of rotation
    # start key -> the engine's startup figures from its log beside the plan's (bench/run/startup_checks.py)
    startup_checks: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def of_run(cls, run_dir: Path) -> RunRecord:
        """What the earlier invocations of a run recorded (resuming)."""
        info = load_run_info(run_dir)
        return cls(**{f.name: dict(info.get(f.name) or {}) for f in fields(cls)})

    def save(self, writer: RunWriter) -> None:
        """Into run.json, atomically, all at once; nothing after a write error, so the first one stands alone."""
        if writer.failed is None:
            writer.update_run_info(**asdict(self))
