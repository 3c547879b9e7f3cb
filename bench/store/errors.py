"""What goes wrong reading and writing runs: one exception (or warning) per kind, with the file it names."""
from __future__ import annotations

from pathlib import Path


class ResultsWriteError(OSError):
    """Writing the results folder failed (disk full, read-only filesystem, permission denied). Raised by
    :class:`RunWriter` (and :func:`write_parquet`, ``kvbench.reports.write``) in place of the OSError; the
    run must stop. ``errno`` is the cause's; the message is one line for the user."""

    def __init__(self, folder: str | Path, doing: str, cause: OSError, intact: bool = True,
                 what: str = "results folder"):
        reason = (cause.strerror or str(cause)).lower()  # e.g. "no space left on device"
        tail = "; everything written before is intact" if intact else ""
        super().__init__(f"{what} {folder}: {reason} ({doing}){tail}")
        self.errno = cause.errno
        self.folder = Path(folder)
        self.doing = doing


class RunFolderError(ValueError):
    """The run folder cannot be used in the asked mode (exists, is not a run folder, nothing to resume)."""


class RunExistsError(RunFolderError):
    """A new run's folder already holds a run."""


class ResultsReadError(ValueError):
    """A run folder's file cannot be read (unreadable run.json, a row of the wrong shape); names the file
    and line. A torn line is not this error: it is skipped and counted (:class:`DamagedLinesWarning`)."""


class ResultsWarning(UserWarning):
    """Something in a run folder was damaged and worked around (nothing intact was lost). ``path`` is the
    file; ``detail`` is the message without the folder, for a report that already names the run."""

    def __init__(self, path: str | Path, detail: str):
        self.path, self.detail = Path(path), detail
        super().__init__(f"{self.path.parent}/{detail}")


class DamagedLinesWarning(ResultsWarning):
    """Lines of a JSONL record that are not whole JSON rows (what a crash mid-append leaves) were skipped."""

    def __init__(self, path: str | Path, lines: list[int]):
        self.lines = list(lines)
        n = len(self.lines)
        shown = ", ".join(map(str, self.lines[:5])) + (", ..." if n > 5 else "")
        super().__init__(path, f"{Path(path).name}: {n} damaged line{'s' if n != 1 else ''} skipped "
                               f"(line{'s' if n != 1 else ''} {shown}: not a whole JSON row, e.g. cut off by a crash)")
