"""Measure transformers' KV cache exactly for one generate call (run inside the hf environment).

Usage: python hf_kv_probe.py (--model DIR | --config JSON_FILE) --prompt N --new M [--batch B] [--dtype bf16]
A --config builds a randomly initialised model of that config (for architectures no package ships).
Prints one JSON object: the cache tensors' bytes, per-layer cached lengths, and the versions used.
"""
import argparse
import json

import torch
import transformers
from hf_worker import CACHE_KWARG, cache_bytes
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

parser = argparse.ArgumentParser()
source = parser.add_mutually_exclusive_group(required=True)
source.add_argument("--model")
source.add_argument("--config")
parser.add_argument("--prompt", type=int, required=True)
parser.add_argument("--new", type=int, required=True)
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
args = parser.parse_args()
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
torch.manual_seed(0)
if args.model:
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
else:
    values = json.load(open(args.config))
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
model.eval()
vocab = model.config.get_text_config().vocab_size
ids = torch.randint(3, vocab, (args.batch, args.prompt))
cache = DynamicCache(config=model.config)
with torch.inference_mode():
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                   min_new_tokens=args.new, do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache})
total, _ = cache_bytes(cache)
lengths = [layer.keys.shape[-2] for layer in cache.layers]
print(json.dumps({"cache_bytes": total, "layer_lengths": lengths, "transformers": transformers.__version__,
                  "layer_types": getattr(model.config.get_text_config(), "layer_types", None)}))
