"""Step "stop and record" of an engine session: the engine stopped first (nothing after it, a full disk
included, may leave it running), then what run.json records of the start: the threads it computed on,
its estimate beside what the cells took, why it stopped, its memory wall and what survived its stop."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvbench.backends.base import Backend
from kvbench.run.rows import failed_row
from kvbench.run.samplers import busy_threads

if TYPE_CHECKING:
    from kvbench.run.session import EngineSession


def stop_and_record(s: EngineSession, backend: Backend) -> None:
    """Stop the engine first (nothing after it, a full disk included, may leave it running), then record
    the threads it computed on, its estimate against what the cells took, why it stopped and what survived."""
    r, label = s.r, s.cfg.label
    threads = busy_threads(backend.pid) if backend.pid else None
    s.progress.update(s.bar, description=f"{label}: stopping")
    survivors = backend.stop()
    if wall := backend.capabilities.memory_wall.record(backend):
        r.record.memory_walls[s.key] = wall
    if s.estimated:  # the estimate beside what the cells took, so its error here can be read
        s.estimated["took_s"] = round(time.monotonic() - s.estimated.pop("started"), 1)
        r.record.estimates[s.key] = s.estimated
    if threads:
        r.record.engine_threads[s.key] = threads
    if survivors:  # the stop could not end the engine's tree: its memory skews whatever runs next
        names = ", ".join(f"{p['pid']} ({p['name']})" for p in survivors)
        row = failed_row(s.info, s.cells[max(0, s.done - 1)], "failed",
                         f"{len(survivors)} process(es) of the engine survived its stop: {names}", "")
        row.cell_id, row.variant = f"{row.cell_id}_stop", "engine stop"  # a row of its own, never a cell's
        r.writer.write_cell(row)
        r.console.print(f"[red]{label}: processes of the engine survived its stop: {names}[/]")
    if not s.cfg.url:
        r.record.engine_stops[s.key] = {"reason": s.stop_reason, "survivors": survivors}
        if restarts := backend.capabilities.memory_wall.guard_restarts(backend):  # a guard of its tree was replaced
            r.record.engine_stops[s.key]["guard_restarts"] = restarts
    r.record.save(r.writer)
