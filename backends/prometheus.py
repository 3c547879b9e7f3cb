"""Reading an engine's Prometheus ``/metrics`` page: only the wanted samples, summed over label sets, and a
mixin for adapters that poll KV in use and their queue from one page.

Telemetry never fails a cell, so the page is read defensively: an answer is read up to
:data:`RESPONSE_CAP_BYTES` and no further (:func:`capped_get`; a longer one is a failed poll), a sample
that is not a number is dropped, and so is a NaN or infinite one (a peak is the finite samples' peak).
What was dropped is counted per thread (:func:`take_dropped`): the poller, which runs in a thread of its
own, says it in the cell's row."""
from __future__ import annotations

import math
import threading
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .types import EngineState, KVInUse

#: The most of one answer read: vLLM's /metrics is ~100 KB; a page of hundreds of MB (a label explosion,
#: a misbehaving exporter) would take the harness's memory and its event loop's time with it.
RESPONSE_CAP_BYTES = 8 << 20


class ResponseTooLarge(httpx.HTTPError):
    """An answer longer than the cap (or slower than its deadline): not read further, a failed poll. An
    ``httpx.HTTPError``, so every caller that treats a failed telemetry call as "not read" treats it so."""


class MetricsSkipped(httpx.HTTPError):
    """A page that hung or overflowed moments ago, not asked again yet: a failed read that costs nothing."""


#: How long a page that hung or overflowed is not asked again.
SKIP_AFTER_FAILURE_S = 5.0


def capped_get(client: httpx.Client, url: str, cap: int = RESPONSE_CAP_BYTES, deadline_s: float | None = None,
               **kwargs) -> httpx.Response:
    """``client.get(url)`` reading at most ``cap`` bytes of the body, within ``deadline_s`` in all (default:
    twice the client's read timeout; a server dripping bytes never trips a per-read timeout); beyond
    either, :class:`ResponseTooLarge` and the connection is closed unread. The response returned holds the
    whole (decoded) body."""
    if deadline_s is None:
        deadline_s = 2 * (client.timeout.read or 5.0)
    give_up = time.monotonic() + deadline_s
    what = httpx.URL(url).path or url  # the path alone: a URL may carry credentials
    with client.stream("GET", url, **kwargs) as response:
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise ResponseTooLarge(f"{what} answered {int(length) / (1 << 20):.0f} MiB, over the "
                                   f"{cap / (1 << 20):g} MiB read at most")
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > cap:
                raise ResponseTooLarge(f"{what} answered over {cap / (1 << 20):g} MiB: not read further")
            if time.monotonic() > give_up:
                raise ResponseTooLarge(f"{what} took over {deadline_s:g} s to answer: not read further")
            chunks.append(chunk)
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]  # decoded already
    return httpx.Response(response.status_code, headers=headers, content=b"".join(chunks),
                          request=response.request)


_dropped = threading.local()


def note_dropped(name: str, reason: str, count: int = 1) -> None:
    """Count a sample dropped in this thread (``name``: the metric or field, ``reason``: why)."""
    counter = getattr(_dropped, "counter", None)
    if counter is None:
        counter = _dropped.counter = Counter()
    counter[(name, reason)] += count


def take_dropped() -> Counter:
    """The samples dropped in this thread since the last call, {(name, reason): count}; then forgets them."""
    counter = getattr(_dropped, "counter", None) or Counter()
    _dropped.counter = Counter()
    return counter


def describe_dropped(dropped: Counter) -> str:
    """"5 samples dropped (3 NaN: vllm:kv_cache_usage_perc; 2 not a number: vllm:num_requests_running)";
    "" for none."""
    if not dropped:
        return ""
    by_reason: dict[str, list] = {}
    for (name, reason), n in sorted(dropped.items()):
        by_reason.setdefault(reason, []).append((name, n))
    parts = [f"{sum(n for _, n in names)} {reason}: {', '.join(name for name, _ in names)}"
             for reason, names in by_reason.items()]
    total = sum(dropped.values())
    return f"{total} sample{'s' if total != 1 else ''} dropped ({'; '.join(parts)})"


class PrometheusPolled:
    """For adapters that read both KV in use and the queue from one Prometheus page (vLLM, TGI): each
    poll fetches ``/metrics`` once and parses only ``POLLED``. Mixed in before :class:`Backend`; the
    adapter says how to read the two figures from the samples (:meth:`kv_from_samples`,
    :meth:`queue_from_samples`)."""

    POLLED: tuple[str, ...] = ()
    _metrics_failed: tuple[float, str] | None = None  # (monotonic time, why) of the last read that hung or overflowed

    def metrics(self, client: httpx.Client, names=None) -> dict[str, list]:
        """The server's /metrics samples (of ``names`` only, when given), read at most
        :data:`RESPONSE_CAP_BYTES`; bad samples dropped and counted (:func:`metric_samples`). For
        :data:`SKIP_AFTER_FAILURE_S` after a read that timed out or overflowed, not asked again
        (:class:`MetricsSkipped`): the harness's reads around each cell would each wait out the timeout."""
        failed = self._metrics_failed
        if failed and time.monotonic() - failed[0] < SKIP_AFTER_FAILURE_S:
            raise MetricsSkipped(f"not asked again within {SKIP_AFTER_FAILURE_S:g} s of {failed[1]}")
        try:
            response = capped_get(client, self.base_url + "/metrics")
        except (httpx.TimeoutException, ResponseTooLarge) as exc:
            self._metrics_failed = (time.monotonic(), f"{type(exc).__name__}: {str(exc)[:120]}")
            raise
        return metric_samples(response.text, names)

    def kv_from_samples(self, samples: dict) -> KVInUse | None:
        raise NotImplementedError

    def queue_from_samples(self, samples: dict) -> dict | None:
        raise NotImplementedError

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        return self.kv_from_samples(self.metrics(client, self.POLLED))

    def queue_state(self, client: httpx.Client) -> dict | None:
        return self.queue_from_samples(self.metrics(client, self.POLLED))

    def poll(self, client: httpx.Client) -> EngineState:
        samples = self.metrics(client, self.POLLED)
        return EngineState(self.kv_from_samples(samples), self.queue_from_samples(samples))


def gauge_sum(samples: dict[str, list], name: str) -> float | None:
    """A sample's values summed over its label sets (engines, models), None when the page lacks it."""
    rows = samples.get(name)
    return sum(v for _, v in rows) if rows else None


def _sample_name(line: str) -> str:
    return line.split("{", 1)[0].split(" ", 1)[0].strip()


def _families(text: str):
    """The page's metric families; where one line cannot be read (a value that is not a number, a broken
    label), the page line by line, each line that cannot be read dropped and counted."""
    try:
        return list(text_string_to_metric_families(text))
    except Exception:  # noqa: BLE001 - the parser raises ValueError, IndexError, KeyError on garbage
        pass
    families = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            families += text_string_to_metric_families(line + "\n")
        except Exception:  # noqa: BLE001
            note_dropped(_sample_name(line)[:80] or "?", "not a number")
    return families


def metric_samples(text: str, names=None) -> dict[str, list]:
    """Prometheus text -> {sample name: [(labels, value), ...]}, of the samples in ``names`` only when given.
    A line that cannot be read and a NaN or infinite value are dropped, each counted (:func:`note_dropped`).

    Polling passes ``names``: vLLM's /metrics is about 600 lines of histograms that take ~10 ms to parse,
    and a poller parsing them at 10 Hz holds the GIL the load generator's event loop needs."""
    if names is not None:
        wanted = frozenset(names)
        text = "\n".join(line for line in text.splitlines()
                         if line and line[0] != "#" and _sample_name(line) in wanted)
    samples: dict[str, list] = {}
    for family in _families(text):
        for s in family.samples:
            if not math.isfinite(s.value):
                note_dropped(s.name, "NaN" if math.isnan(s.value) else ("+Inf" if s.value > 0 else "-Inf"))
                continue
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples
