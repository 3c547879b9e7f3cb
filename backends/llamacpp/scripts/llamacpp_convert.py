"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py of the llama.cpp sources kvbench builds),
run by an interpreter with torch and transformers (the hf environment's), for several models in one process.

Usage: python llamacpp_convert.py LLAMA_CPP_SOURCES OUTTYPE [HF_DIR OUT_GGUF]...
The test models kvbench builds carry a byte-level BPE tokenizer.json only; the architectures whose converter
insists on a SentencePiece tokenizer.model (Gemma 2, MiniCPM3) then take the tokenizer.json path, as the
others do. The tokenizer does not change the KV cache. Prints one JSON list: per model "ok" or the error.
"""
import json
import runpy
import sys
from pathlib import Path

sources, outtype, pairs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
sys.path[:0] = [str(sources), str(sources / "gguf-py")]
import conversion.base as base  # noqa: E402

sentencepiece = base.TextModel._set_vocab_sentencepiece


def sentencepiece_or_bpe(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").exists():
        return self._set_vocab_gpt2()
    return sentencepiece(self, *args, **kwargs)


base.TextModel._set_vocab_sentencepiece = sentencepiece_or_bpe
converter = runpy.run_path(str(sources / "convert_hf_to_gguf.py"), run_name="kvbench_convert")
results = []
for hf_dir, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype]
    try:
        converter["main"]()
        results.append("ok")
    except (Exception, SystemExit) as exc:
        results.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500])
print(json.dumps(results))
