"""The KV cache lines ``llama-server`` logs at start (with ``-lv 4``), wherever it runs: llama.cpp's own log,
and Ollama's server log, which carries its runner's lines since v0.30."""
from __future__ import annotations

import re

# llama_kv_cache: size =   90.00 MiB (  4096 cells,  30 layers,  1/1 seqs), K (f16):   45.00 MiB, V (f16):   45.00 MiB
# (older builds prefix the line with llama_kv_cache_unified: and use the same fields); sizes are decimal numbers
# (a garbled "1.2.3" does not match: the line is not read, rather than failing the pool read). "N/S seqs" is
# n_seq_max / n_stream (src/llama-kv-cache.cpp): equal with a stream per slot, "4/1" for 4 slots sharing one
# unified stream (--kv-unified), whose cells are the whole pool
KV_LINE = re.compile(
    r"llama_kv_cache(?:_unified)?: size =\s*(?P<mib>\d+(?:\.\d+)?) MiB \(\s*(?P<cells>\d+) cells,\s*(?P<layers>\d+) layers,"
    r"\s*(?P<seqs_max>\d+)/(?P<streams>\d+) seqs\), K \((?P<type_k>\w+)\):\s*(?P<k_mib>\d+(?:\.\d+)?) MiB, "
    r"V \((?P<type_v>\w+)\):\s*(?P<v_mib>\d+(?:\.\d+)?) MiB")


def parse_kv_log(text: str) -> list[dict]:
    """Every KV cache the server allocated, as logged (one entry per cache; SWA models have two)."""
    caches = []
    for m in KV_LINE.finditer(text):
        caches.append({"mib": float(m["mib"]), "cells": int(m["cells"]), "layers": int(m["layers"]),
                       "streams": int(m["streams"]), "seqs": int(m["seqs_max"]), "type_k": m["type_k"], "type_v": m["type_v"],
                       "k_mib": float(m["k_mib"]), "v_mib": float(m["v_mib"])})
    return caches
