"""A fake vLLM replica: tests/fakes/openai_server.py's completions server plus vLLM's ``/health`` and its
Prometheus ``/metrics`` page, so that several of them can stand for the replicas of a deployment, each
with KV figures of its own.

``/metrics`` is a real vLLM 0.32.0 page (tests/fakes/data/vllm-0.32.0-metrics.txt) with these samples set
from the fake's own state, as vLLM sets them:

- ``vllm:cache_config_info``: ``num_gpu_blocks`` and ``block_size`` of this replica's pool (and
  ``kv_cache_memory_bytes``, the budget, as given);
- ``vllm:kv_cache_usage_perc``: blocks held by the running requests / (num_gpu_blocks - 1) (the null
  block is not usable); a running request holds ceil((prompt + max_tokens) / block_size) blocks from the
  moment it is admitted (the fake's simplification: vLLM allocates them as the sequence grows);
- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: at most ``max_running`` requests are
  admitted at once (vLLM's max_num_seqs); the others wait for a free one and are counted as waiting.

Every request served is listed in ``served`` (its prompt length and when it was admitted).
"""
from __future__ import annotations

import io
import json
import math
import re
import threading
import time
from pathlib import Path

from tests.fakes._http import count_words
from tests.fakes.openai_server import FakeOpenAI, OpenAIHandler

PAGE = (Path(__file__).parent / "data" / "vllm-0.32.0-metrics.txt").read_text()


def set_sample(page: str, name: str, value: float) -> str:
    pattern = re.compile(rf'^({re.escape(name)}\{{engine="0",model_name="smollm2"\}}) .*$', re.MULTILINE)
    assert pattern.search(page), name
    return pattern.sub(lambda m: f"{m.group(1)} {float(value)!r}", page)


class ReplicaHandler(OpenAIHandler):
    def do_GET(self):
        fake: FakeReplica = self.server.fake
        if self.path == "/health":
            return self.send_bytes(200, b"", "application/json")
        if self.path == "/metrics":
            return self.send_text(200, fake.metrics_page(), "text/plain; version=0.0.4; charset=utf-8")
        return super().do_GET()

    def do_POST(self):
        fake: FakeReplica = self.server.fake
        if self.path != "/v1/completions":
            return super().do_POST()
        raw = self.read_body()
        req = json.loads(raw) if raw else {}
        prompt = req.get("prompt")
        n_prompt = len(prompt) if isinstance(prompt, list) else count_words(prompt or "")
        blocks = math.ceil((n_prompt + int(req.get("max_tokens") or 16)) / fake.block_size)
        with fake.lock:
            fake.waiting += 1
        fake.slots.acquire()
        with fake.lock:
            fake.waiting -= 1
            fake.running += 1
            fake.blocks_held += blocks
            fake.served.append({"prompt_tokens": n_prompt, "t_admitted": time.monotonic()})
        rfile = self.rfile
        self.rfile = io.BytesIO(raw)  # the parent reads the body again
        try:
            super().do_POST()
        finally:
            self.rfile = rfile
            with fake.lock:
                fake.running -= 1
                fake.blocks_held -= blocks
            fake.slots.release()


class FakeReplica(FakeOpenAI):
    handler = ReplicaHandler

    def __init__(self, num_gpu_blocks: int = 67, block_size: int = 128, max_running: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.num_gpu_blocks, self.block_size, self.max_running = num_gpu_blocks, block_size, max_running
        self.slots = threading.Semaphore(max_running)
        self.running = self.waiting = self.blocks_held = 0
        self.served: list[dict] = []

    @property
    def pool_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def metrics_page(self) -> str:
        with self.lock:
            running, waiting, held = self.running, self.waiting, self.blocks_held
        page = set_sample(PAGE, "vllm:num_requests_running", running)
        page = set_sample(page, "vllm:num_requests_waiting", waiting)
        page = set_sample(page, "vllm:kv_cache_usage_perc", held / (self.num_gpu_blocks - 1))
        return (page.replace('num_gpu_blocks="67"', f'num_gpu_blocks="{self.num_gpu_blocks}"')
                    .replace('block_size="128"', f'block_size="{self.block_size}"'))
