"""Measure transformers' KV cache exactly, one generate call per job (run inside the hf environment).

Usage: python hf_kv_probe.py JOBS_JSON
JOBS_JSON is a list of {"model": DIR | "config": {...}, "prompt": N, "new": M, "batch": B, "dtype": "bf16"};
a "config" builds a randomly initialised model of that config; a "cache_config" ({"backend": "quanto", "nbits": 4,
...}) makes the cache transformers' QuantizedCache instead of a DynamicCache. Prints one JSON list: per job the cache
tensors' bytes, the per-layer cached lengths (None for a layer with no K/V), or the error that stopped it.
"""
import json
import sys

import torch
import transformers
from hf_worker import CACHE_KWARG, cache_bytes
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, QuantizedCache

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measure(job: dict) -> dict:
    dtype = DTYPES[job.get("dtype", "bf16")]
    torch.manual_seed(0)
    if "model" in job:
        model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype)
    else:
        values = dict(job["config"])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    batch, prompt, new = job.get("batch", 1), job["prompt"], job["new"]
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (batch, prompt))
    if job.get("cache_config"):
        setting = dict(job["cache_config"])
        cache = QuantizedCache(backend=setting.pop("backend", "quanto"),
                               config=model.config.get_text_config(decoder=True), **setting)
    else:
        cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache})
    total, _ = cache_bytes(cache)
    lengths = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        # a quantised layer: its keys are the residual only (a sliding-window layer's cumulative_length
        # counts every token seen, not the window it holds)
        if hasattr(layer, "_quantized_keys"):
            lengths.append(int(layer.cumulative_length))
            continue
        lengths.append(None if keys is None or not keys.numel() else keys.shape[-2])
    return {"cache_bytes": total, "layer_lengths": lengths, "transformers": transformers.__version__,
            "layer_types": getattr(model.config.get_text_config(), "layer_types", None)}


results = []
for job in json.load(open(sys.argv[1])):
    try:
        results.append(measure(job))
    except Exception as exc:  # one job's failure (an architecture this transformers lacks) is its row, not the run's
        results.append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]})
print(json.dumps(results))
