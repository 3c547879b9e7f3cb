"""Reading an engine's Prometheus ``/metrics`` page: only the wanted samples, summed over label sets, and a
mixin for adapters that poll KV in use and their queue from one page."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .types import EngineState, KVInUse


class PrometheusPolled:
    """For adapters that read both KV in use and the queue from one Prometheus page (vLLM, TGI): each
    poll fetches ``/metrics`` once and parses only ``POLLED``. Mixed in before :class:`Backend`; the
    adapter says how to read the two figures from the samples (:meth:`kv_from_samples`,
    :meth:`queue_from_samples`)."""

    POLLED: tuple[str, ...] = ()

    def metrics(self, client: httpx.Client, names=None) -> dict[str, list]:
        """The server's /metrics samples (of ``names`` only, when given)."""
        return metric_samples(client.get(self.base_url + "/metrics").text, names)

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


def metric_samples(text: str, names=None) -> dict[str, list]:
    """Prometheus text -> {sample name: [(labels, value), ...]}, of the samples in ``names`` only when given.

    Polling passes ``names``: vLLM's /metrics is about 600 lines of histograms that take ~10 ms to parse,
    and a poller parsing them at 10 Hz holds the GIL the load generator's event loop needs."""
    if names is not None:
        wanted = frozenset(names)
        text = "\n".join(line for line in text.splitlines()
                         if line and line[0] != "#" and line.split("{", 1)[0].split(" ", 1)[0] in wanted)
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples
