"""Turn a GGUF file into an HF-format folder (bf16 safetensors + tokenizer), run inside the hf environment.

transformers dequantises the GGUF on load but refuses to save_pretrained a GGUF-loaded model, so the
weights are copied into a fresh model of the same config and that one is saved.
Usage: python hf_convert_gguf.py GGUF_FILE OUT_DIR
"""
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

gguf_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
kwargs = {"gguf_file": gguf_path.name}
tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
config.dtype = torch.bfloat16
fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
# Tied embeddings legitimately have no separate lm_head in the GGUF; anything else is a real loss.
missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
if missing or unexpected:
    sys.exit(f"weights did not map onto the config: missing={missing} unexpected={unexpected}")
out_dir.mkdir(parents=True, exist_ok=True)
fresh.save_pretrained(out_dir, safe_serialization=True)
tokenizer.save_pretrained(out_dir)
print(f"saved {out_dir}")
