"""Telemetry from the cluster's own monitoring: GPU memory per device from NVIDIA's DCGM exporter and the
engines' own metrics, read back from Prometheus (its HTTP API) for each cell, for servers kvbench did not
start (``kvbench run --prometheus URL [--prometheus-selector '{namespace="llm"}']``; docs/telemetry.md).

What is read (names, units and labels as the exporters write them):

- DCGM exporter (``etc/default-counters.csv`` of NVIDIA/dcgm-exporter): ``DCGM_FI_DEV_FB_USED``,
  ``DCGM_FI_DEV_FB_FREE`` and ``DCGM_FI_DEV_FB_RESERVED`` (gauges, MiB), one series per GPU, labelled
  ``gpu`` (index), ``UUID``, ``pci_bus_id``, ``device``, ``modelName`` and ``Hostname`` (``hostname`` since
  the exporter's 2026 rename), plus ``job``/``instance`` from Prometheus and pod labels under Kubernetes.
- vLLM: ``vllm:kv_cache_usage_perc`` (a fraction 0-1, despite the name), ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:num_preemptions_total`` (a counter).
- llama.cpp's server (``--metrics``): ``llamacpp:requests_processing``, ``llamacpp:requests_deferred``
  and, in builds that still have it, ``llamacpp:kv_cache_usage_ratio``.

How a cell is read: the samples Prometheus scraped during the cell's wall-clock window, exactly as
scraped (an instant query of a range vector, ``{...}[Nms]``, which returns every raw sample with its scrape
timestamp), not ``query_range``: a range query resamples at its step and fills each step with the last
sample up to five minutes old, so a peak over it would include the previous cell's value and its times
would be the step's, not the scrape's. Before reading, the client waits until every series has a sample at
or after the cell's end, so the last scrape of the cell is in: up to 1.5 scrape intervals of the series'
jobs plus a second (from the targets API; 5 s where it cannot be read).

Alignment: the runner's times are ``time.perf_counter()`` seconds; Prometheus stamps samples with the
scraping server's wall clock (Unix seconds). :func:`wall_clock_offset` measures ``time.time() -
time.perf_counter()`` here, which puts each sample on the cell's axis (``t_s`` = seconds since the cell
started, as in ``timelines/<cell_id>.csv``); the row records the cell's start in Unix seconds
(``t_cell_start_unix``). A Prometheus on another machine stamps with that machine's clock: its offset from
this one (NTP: usually under a few ms) shifts the samples by as much.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import httpx
import pandas as pd

from kvbench.backends import REGISTRY
from kvbench.backends.prometheus import capped_get, describe_dropped, note_dropped, take_dropped
from kvbench.common.redact import redact_text, redact_url, scrub

MIB = 1 << 20
#: The most of one Prometheus answer read: a cell's raw samples of a few dozen series are well under 1 MiB;
#: beyond this the cell's telemetry is "not measured" rather than the harness's memory taken.
ANSWER_CAP_BYTES = 16 << 20

#: DCGM exporter's framebuffer gauges (MiB) and the name of each in the samples' ``metric`` column.
GPU_METRICS = {"DCGM_FI_DEV_FB_USED": "gpu_used", "DCGM_FI_DEV_FB_FREE": "gpu_free",
               "DCGM_FI_DEV_FB_RESERVED": "gpu_reserved"}


@cache
def engine_metrics() -> dict[str, str]:
    """The engines' own metrics, by what each says: every adapter's Telemetry capability's ``prometheus_metrics``."""
    return {name: what for cls in REGISTRY.values()
            for name, what in cls.capabilities.telemetry.prometheus_metrics.items()}

UNITS = {"gpu_used": "bytes", "gpu_free": "bytes", "gpu_reserved": "bytes", "kv_usage": "fraction",
         "requests_running": "requests", "requests_waiting": "requests", "preemptions": "count"}
LABELS = ("gpu", "UUID", "modelName", "hostname", "pci_bus_id", "job", "instance")  # kept in the samples CSV
SAMPLE_COLUMNS = ["t_s", "unix_s", "metric", "value", "unit", "source_metric", *LABELS]

_MATCHER = re.compile(r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*')


class TelemetryError(RuntimeError):
    """Prometheus could not be read (unreachable, an error answer, a malformed one)."""


def selector_matchers(selector: str | None) -> str:
    """The label matchers of a selector such as ``{job="vllm",namespace=~"llm.*"}``, without braces
    (``""`` for none); ValueError when it is not a list of matchers (it is pasted into every query)."""
    text = (selector or "").strip()
    if not text:
        return ""
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"a Prometheus selector is label matchers in braces, e.g. '{{job=\"vllm\"}}', not {selector!r}")
    inner = text[1:-1].strip().rstrip(",")
    pos = 0
    while pos < len(inner):
        m = _MATCHER.match(inner, pos)
        if not m:
            raise ValueError(f"cannot read the label matchers in {selector!r} (e.g. '{{job=\"vllm\",gpu=~\"0|1\"}}')")
        pos = m.end()
        if pos < len(inner):
            if inner[pos] != ",":
                raise ValueError(f"label matchers in {selector!r} must be separated by commas")
            pos += 1
    return inner


def series_query(names, matchers: str) -> str:
    """One selector for several metrics: ``{__name__=~"a|b",<matchers>}``."""
    pattern = "|".join(re.escape(n) for n in names)
    return "{" + f'__name__=~"{pattern}"' + (f",{matchers}" if matchers else "") + "}"


@dataclass
class Series:
    """One time series: its labels (``__name__`` included) and its raw samples as (Unix seconds, value)."""

    labels: dict
    points: list[tuple[float, float]]

    @property
    def name(self) -> str:
        return self.labels.get("__name__", "")


def parse_matrix(payload: dict) -> list[Series]:
    """The series of a Prometheus API answer whose result is a matrix (``/api/v1/query`` of a range vector,
    or ``/api/v1/query_range``); TelemetryError for an error answer or another result type."""
    if not isinstance(payload, dict) or payload.get("status") != "success":
        error = payload.get("error") if isinstance(payload, dict) else None
        raise TelemetryError(f"Prometheus answered {payload.get('errorType', 'an error') if isinstance(payload, dict) else 'non-JSON'}: {error}")
    data = payload.get("data") or {}
    if data.get("resultType") != "matrix":
        raise TelemetryError(f"expected a matrix from Prometheus, got {data.get('resultType')!r}")
    out = []
    for item in data.get("result") or []:
        try:
            labels, values = dict(item.get("metric") or {}), list(item.get("values") or [])
        except (AttributeError, TypeError, ValueError):
            note_dropped("?", "series not readable")
            continue
        out.append(Series(labels, finite_points(labels.get("__name__", "?"), values)))
    return out


def finite_points(name: str, values: list) -> list[tuple[float, float]]:
    """A series' [timestamp, "value"] pairs as floats; a pair that is not two numbers, and a NaN or infinite
    value, dropped and counted (:func:`kvbench.backends.prometheus.note_dropped`)."""
    points = []
    for pair in values:
        try:
            ts, value = pair
            ts, value = float(ts), float(value)
        except (TypeError, ValueError):
            note_dropped(name, "not a number")
            continue
        if not (math.isfinite(value) and math.isfinite(ts)):
            note_dropped(name, "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf"))
            continue
        points.append((ts, value))
    return points


def parse_duration(text: str) -> float | None:
    """A Prometheus duration ("1s", "15s", "1m30s", "500ms") in seconds; None when it is not one."""
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", text or "")
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    return sum(int(n) * scale[u] for n, u in parts)


def wall_clock_offset(pairs: int = 5) -> float:
    """``time.time() - time.perf_counter()``: the Unix time of perf_counter's zero, the median of a few
    back-to-back readings (a reading that straddles a context switch is off by the switch)."""
    readings = []
    for _ in range(pairs):
        a = time.perf_counter()
        w = time.time()
        b = time.perf_counter()
        readings.append(w - (a + b) / 2)
    return statistics.median(readings)


def device_key(labels: dict) -> str:
    """A GPU's name across a cluster: its UUID; else host and index."""
    if labels.get("UUID"):
        return labels["UUID"]
    host = labels.get("Hostname") or labels.get("hostname") or labels.get("instance") or ""
    return f"{host}/gpu{labels.get('gpu', '?')}"


def _value(metric: str, raw: float) -> float:
    return raw * MIB if UNITS[metric] == "bytes" else raw


def samples_frame(series: list[Series], t0_unix: float, start_unix: float, end_unix: float) -> pd.DataFrame:
    """The samples inside [start, end] on the cell's time axis (``t_s`` = seconds since ``t0_unix``), DCGM's
    MiB converted to bytes; one row per sample with the labels that say which GPU or engine it is."""
    rows = []
    for s in series:
        metric = GPU_METRICS.get(s.name) or engine_metrics().get(s.name)
        if metric is None:
            continue
        labels = {k: s.labels.get(k) for k in LABELS}
        labels["hostname"] = s.labels.get("Hostname") or s.labels.get("hostname")
        for ts, raw in s.points:
            if start_unix <= ts <= end_unix:
                rows.append({"t_s": ts - t0_unix, "unix_s": ts, "metric": metric, "value": _value(metric, raw),
                             "unit": UNITS[metric], "source_metric": s.name, **labels})
    return pd.DataFrame(rows, columns=SAMPLE_COLUMNS).sort_values(["t_s", "metric"], kind="stable") \
        .reset_index(drop=True)


def _finite(values):
    return [v for v in values if not math.isnan(v)]


def cell_figures(series: list[Series], start_unix: float, end_unix: float) -> dict:
    """The row's figures from the series, of the samples inside [start, end]: GPU memory used at its peak
    per device (bytes; ``prom_gpu_devices``, one dict per GPU) and on the fullest one; per engine
    (``instance``) its KV usage, running and waiting peaks (``prom_engines``), the fullest engine's KV
    usage and the busiest one's queue peaks; and preemptions during the cell, summed over engines
    (counter increase from the last sample before the cell; a counter that went down was reset and counts
    from zero). None where no sample of the kind fell inside the cell. Lists of dicts, not dicts keyed by
    device: a Parquet copy keeps them as they are."""
    devices: dict[str, dict] = {}
    engines: dict[str, dict] = {}
    preemptions, n = None, 0
    for s in series:
        values = _finite([v for ts, v in s.points if start_unix <= ts <= end_unix])
        n += len(values)
        if not values:
            continue
        if s.name == "DCGM_FI_DEV_FB_USED":
            key = device_key(s.labels)
            d = devices.setdefault(key, {"device": key, "gpu": s.labels.get("gpu"),
                                         "hostname": s.labels.get("Hostname") or s.labels.get("hostname"),
                                         "model": s.labels.get("modelName"), "used_peak_bytes": 0.0})
            d["used_peak_bytes"] = max(d["used_peak_bytes"], max(values) * MIB)
        metric = engine_metrics().get(s.name)
        if metric in ("kv_usage", "requests_running", "requests_waiting"):
            e = engines.setdefault(s.labels.get("instance", ""), {
                "instance": s.labels.get("instance", ""), "kv_usage_peak": None, "requests_running_peak": None,
                "requests_waiting_peak": None})
            field_name = f"{metric}_peak"
            e[field_name] = max(values) if e[field_name] is None else max(e[field_name], max(values))
        if metric == "preemptions":
            before = [v for ts, v in s.points if ts < start_unix and not math.isnan(v)]
            base = before[-1] if before else values[0]
            grown = 0.0
            for v in values:
                grown += v - base if v >= base else v
                base = v
            preemptions = (preemptions or 0.0) + grown

    def peak(key):
        known = [e[key] for e in engines.values() if e[key] is not None]
        return max(known) if known else None

    return {
        "prom_gpu_used_peak_bytes": max(d["used_peak_bytes"] for d in devices.values()) if devices else None,
        "prom_gpu_devices": sorted(devices.values(), key=lambda d: (d["hostname"] or "", d["gpu"] or "", d["device"])),
        "prom_kv_usage_peak": peak("kv_usage_peak"),
        "prom_requests_running_peak": peak("requests_running_peak"),
        "prom_requests_waiting_peak": peak("requests_waiting_peak"),
        "prom_preemptions": preemptions,
        "prom_engines": [engines[k] for k in sorted(engines)],
        "prom_samples": n,
    }


@dataclass
class CellTelemetry:
    """What Prometheus gave for one cell: the row's figures (``prom_*`` columns, ``t_cell_start_unix``) and
    the samples on the cell's time axis (written to ``telemetry/<cell_id>.csv``)."""

    figures: dict
    samples: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=SAMPLE_COLUMNS))


class Prometheus:
    """A Prometheus server's HTTP API, read after each cell. ``selector``: label matchers for every query
    (e.g. ``{namespace="llm"}``); ``gpu_selector``: for the DCGM series instead, where the GPUs are
    scraped under other labels than the engines (default: ``selector``). A URL's ``user:password@`` is
    sent as basic auth. ``settle_s``: how long to wait after a cell for every series' next scrape (None:
    1.5 scrape intervals of the series' jobs plus a second, from the targets API; 5 s where that cannot be
    read)."""

    def __init__(self, url: str, selector: str = "", gpu_selector: str | None = None, settle_s: float | None = None,
                 timeout_s: float = 10.0, lookback_s: float = 30.0):
        self.url = url.rstrip("/")
        self.selector, self.gpu_selector = selector or "", gpu_selector
        self.matchers = selector_matchers(selector)
        self.gpu_matchers = self.matchers if gpu_selector is None else selector_matchers(gpu_selector)
        self.settle_s, self.timeout_s, self.lookback_s = settle_s, timeout_s, lookback_s
        self._http: httpx.Client | None = None
        self._intervals: dict[str, float] | None = None  # scrape interval per job, from the targets API

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(timeout=self.timeout_s)
        return self._http

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def describe(self) -> str:
        """The Prometheus and its selectors, for the row (credentials in the URL masked)."""
        return redact_url(self.url) + (f" {self.selector}" if self.selector else "") + \
            (f", GPUs {self.gpu_selector}" if self.gpu_selector is not None else "")

    def raw_series(self, query: str, start_unix: float, end_unix: float) -> list[Series]:
        """Every sample of ``query``'s series scraped in [start, end] (Unix seconds), as scraped."""
        window_ms = max(1, math.ceil((end_unix - start_unix) * 1000))
        try:
            response = capped_get(self.http, self.url + "/api/v1/query", cap=ANSWER_CAP_BYTES,
                                  params={"query": f"{query}[{window_ms}ms]", "time": f"{end_unix:.3f}"})
            payload = response.json()
        except httpx.HTTPError as exc:  # ResponseTooLarge included: an answer over the cap is not read
            raise TelemetryError(f"{type(exc).__name__}: {redact_text(str(exc))}") from None
        except ValueError:
            # every held credential masked before the cut: a key echoed across it would leave a piece
            raise TelemetryError(f"HTTP {response.status_code}, not JSON: {scrub(response.text)[:200]}") from None
        return parse_matrix(payload)

    def queries(self) -> list[str]:
        return [series_query(GPU_METRICS, self.gpu_matchers), series_query(engine_metrics(), self.matchers)]

    def scrape_intervals(self) -> dict[str, float]:
        """Seconds between scrapes per job, from ``/api/v1/targets`` (read once; {} where it cannot be)."""
        if self._intervals is None:
            self._intervals = {}
            try:
                targets = self.http.get(self.url + "/api/v1/targets", params={"state": "active"}).json()
                for t in targets["data"]["activeTargets"]:
                    job, interval = t["labels"].get("job"), parse_duration(t.get("scrapeInterval", ""))
                    if job and interval:
                        self._intervals[job] = max(self._intervals.get(job, 0.0), interval)
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
        return self._intervals

    def settle_for(self, series: list[Series]) -> float:
        """How long to wait for the series' next scrapes: ``settle_s``, else 1.5 of their jobs' longest
        scrape interval plus a second (at most two minutes), else 5 s."""
        if self.settle_s is not None:
            return self.settle_s
        intervals = self.scrape_intervals()
        known = [intervals[j] for j in {s.labels.get("job") for s in series} if j in intervals]
        return min(120.0, 1.5 * max(known) + 1.0) if known else 5.0

    def read(self, start_unix: float, end_unix: float) -> tuple[list[Series], str]:
        """The series of the window (with ``lookback_s`` before it, for counters' baselines), waiting (up
        to :meth:`settle_for`) for a scrape at or after ``end_unix`` of every series; and a note when some
        series had none by then."""
        started, settle = time.monotonic(), None
        while True:
            now = time.time()
            take_dropped()  # the last read's drops only: each series is read again until it is complete
            series = [s for q in self.queries() for s in self.raw_series(q, start_unix - self.lookback_s,
                                                                           max(now, end_unix))]
            dropped = take_dropped()
            late = [s for s in series if not s.points or s.points[-1][0] < end_unix]
            if late and settle is None:
                settle = self.settle_for(series)
            if not late or time.monotonic() - started >= settle:
                break
            time.sleep(0.2)
        note = ""
        if late:
            gap = max(end_unix - (s.points[-1][0] if s.points else start_unix) for s in late)
            note = (f"; {len(late)} series without a scrape after the cell's end within {settle:g} s "
                    f"(last up to {gap:.1f} s before it)")
        if dropped:  # a peak is then the finite samples' peak
            note += f"; {describe_dropped(dropped)}"
        return series, note

    def cell(self, t0: float, t1: float) -> CellTelemetry:
        """The cell from ``t0`` to ``t1`` (perf_counter seconds): its figures and samples. Never raises:
        a Prometheus that cannot be read gives "not measured" figures that say why."""
        offset = wall_clock_offset()
        start_unix, end_unix = t0 + offset, t1 + offset
        base = {"t_cell_start_unix": start_unix}
        try:
            return self._cell(start_unix, end_unix, base)
        except TelemetryError as exc:
            return CellTelemetry({**base, "prom_source": f"not measured: {self.describe()}: {exc}"})
        except Exception as exc:  # noqa: BLE001 - telemetry never fails a cell: an answer of a shape not foreseen
            return CellTelemetry({**base, "prom_source": f"not measured: {self.describe()}: "
                                                         f"{type(exc).__name__}: {scrub(redact_text(str(exc)))[:200]}"})

    def _cell(self, start_unix: float, end_unix: float, base: dict) -> CellTelemetry:
        series, note = self.read(start_unix, end_unix)
        figures = cell_figures(series, start_unix, end_unix)
        found = sorted({s.name for s in series if any(start_unix <= ts <= end_unix for ts, _ in s.points)})
        if not figures["prom_samples"]:
            source = f"not measured: no sample of {self.describe()} inside the cell ({end_unix - start_unix:.1f} s)"
        else:
            source = f"{figures['prom_samples']} samples of {', '.join(found)} from {self.describe()}"
        return CellTelemetry({**base, **figures, "prom_source": source + note},
                             samples_frame(series, start_unix, start_unix, end_unix))


def write_samples(run_dir: str | Path, cell_id: str, telemetry: CellTelemetry) -> Path | None:
    """``telemetry/<cell_id>.csv`` in the run folder (replaced atomically); nothing when there is no sample.
    A write error is the run's :class:`~kvbench.store.errors.ResultsWriteError`."""
    from kvbench.common.files import atomic_write_text
    from kvbench.store.errors import ResultsWriteError

    if telemetry.samples.empty:
        return None
    if not cell_id or cell_id in (".", "..") or any(c in cell_id for c in "/\\\0"):
        raise ValueError(f"cell id {cell_id!r} cannot be a file name in the run folder")
    path = Path(run_dir) / "telemetry" / f"{cell_id}.csv"
    try:
        path.parent.mkdir(exist_ok=True)
        atomic_write_text(path, telemetry.samples.to_csv(index=False))
    except OSError as exc:
        raise ResultsWriteError(run_dir, f"writing telemetry/{path.name}", exc) from exc
    return path


def measure_cell(prometheus: Prometheus | None, t0: float, t1: float, run_dir: str | Path,
                 cell_id: str) -> dict | None:
    """The runner's one call after a cell: read Prometheus (when configured), write the samples, and
    return the figures for the row (None without ``--prometheus``)."""
    if prometheus is None:
        return None
    telemetry = prometheus.cell(t0, t1)
    write_samples(run_dir, cell_id, telemetry)
    return telemetry.figures
