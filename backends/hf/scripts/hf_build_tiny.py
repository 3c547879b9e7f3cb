"""Build small random-weight models from configs (run inside the hf environment): KV and memory need no
trained weights. Each model gets the tokenizer of TOKENIZER_DIR (its vocab_size must match).

Usage: python hf_build_tiny.py TOKENIZER_DIR JOBS_JSON
JOBS_JSON is a list of {"config": {...}, "out": DIR}. Prints one JSON list: per job the parameter count or the error.
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

tokenizer_dir = Path(sys.argv[1])
results = []
for job in json.load(open(sys.argv[2])):
    out = Path(job["out"])
    try:
        values = dict(job["config"])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, staging / name)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)  # only a complete model ever has the final name
        results.append({"parameters": sum(p.numel() for p in model.parameters())})
    except Exception as exc:
        results.append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]})
print(json.dumps(results))
