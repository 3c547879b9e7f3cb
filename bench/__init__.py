"""kvbench: measured KV-cache memory, throughput and latency of LLM inference engines."""
__version__ = "0.1.0"
