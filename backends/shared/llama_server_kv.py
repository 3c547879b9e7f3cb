"""The KV rules of llama.cpp's ``llama-server``: how it sizes, stores and rounds its cache. Every engine that
runs llama-server (llama.cpp itself, Ollama) extends them in its own kvrules.py. Imports only kvbench.kv."""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from kvbench.kv.geometry import KVGeometry, LayerKV, decompressed, round_up
from kvbench.kv.rules import Choice, KVAnswer, KVQuestion, KVRuleError, KVRules, Switch, Whole
from kvbench.kv.speculative import DraftKV, ngram_kv
from kvbench.kv.startup import StartupQuestion

from . import llama_server_gpumem as gpumem

# HF model types whose llama.cpp architecture keeps a window (src/models/*.cpp set swa_type): the others'
# windows are sized full (Mistral, Qwen2: the converter writes no window, the architecture reads none).
SWA_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gpt_oss", "cohere2",
                             "exaone4", "llama4", "llama4_text"})
LLAMA4_CHUNK = 8192  # llama.cpp sets Llama 4's n_swa to 8192 whatever the file says (src/models/llama4.cpp)
# HF model types converted to an MLA architecture (conversion/deepseek.py, glm.py, kimi_linear.py write
# key_length_mla): the cache holds the latent, K only. MiniCPM3 is converted decompressed.
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe_lite", "glm_moe_dsa",
                             "kimi_linear"})
PAD = 256  # llama.cpp pads n_ctx and every cache's cells to 256
UBATCH = 512  # llama-server's default n_ubatch
CACHE_RAM_MIB = 8192  # llama-server's default --cache-ram (its prompt cache's limit in host RAM)


class LlamaServerKV(KVRules):
    """llama.cpp's KV cache (the llama.cpp vendored in llama-cpp-python 0.3.36 read: src/llama-context.cpp,
    src/llama-kv-cache*.cpp, src/models/*.cpp, conversion/*.py), as llama-server allocates it at start:

    - n_ctx = batch x context padded to 256; with one stream per slot (-np batch, no unified cache) each
      slot has n_ctx / slots cells, padded to 256; the whole pool is allocated up front;
    - a layer with a window (only in :data:`SWA_MODEL_TYPES`) is in a second cache of
      min(cells, window x (slots if unified else 1) + n_ubatch) cells, padded to 256 (Llama 4's chunks: 8192);
    - MLA (:data:`MLA_MODEL_TYPES`): the latent, K only; MiniCPM3 decompressed (V of hidden / heads, which
      is its v_head_dim);
    - quantised types with their block scales (q8_0: 34 bytes per 32 values);
    - several GPUs split the layers (--split-mode layer), not the heads: a GPU holds whole layers.
    A GGUF's own metadata already says what llama.cpp caches, so its geometry is taken as it is.
    Each engine that runs llama-server sets its ``engine`` and ``version``.
    """

    # what `kvbench plan --engine-option` takes (KVQuestion.options): -kvu, --cache-ram (0: off; its -1, no limit,
    # is not planned), -ub, -fa on|off|auto, and the draft context's --cache-type-k-draft/-v-draft (its allowed values)
    rule_options = {"unified": Switch(), "cache_ram_mib": Whole(0, unit="MiB"), "n_ubatch": Whole(),
                    "flash_attn": Choice(("on", "off", "auto"), (("true", "on"), ("1", "on"), ("yes", "on"),
                                                                 ("false", "off"), ("0", "off"), ("no", "off"))),
                    "draft_kv_dtype": Choice(("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"))}
    model_format = "gguf"
    dtypes = {"f16": "f16", "fp16": "f16", "float16": "f16", "bf16": "bf16", "bfloat16": "bf16", "f32": "f32",
              "fp32": "f32", "float32": "f32", "q8_0": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0",
              "q5_1": "q5_1", "iq4_nl": "iq4_nl"}

    def auto_dtype(self, q: KVQuestion) -> str:
        return "f16"  # llama.cpp's --cache-type-k/-v default

    def prefix_reuse_unit(self, q: KVQuestion, details: dict | None = None) -> int | None:
        """Any common prefix with the slot's cached prompt, token by token (server-context.cpp:
        get_common_prefix, with cache_prompt); each slot holds its own copy."""
        return 1

    def stored(self, q: KVQuestion) -> KVGeometry:
        g = q.geometry
        if g.source == "gguf":
            return g
        if g.mla and g.model_type not in MLA_MODEL_TYPES:
            g = decompressed(g)
        layers = []
        for layer in g.layers:
            if layer.kind in ("sliding", "chunked") and g.model_type not in SWA_MODEL_TYPES:
                layer = LayerKV("full", layer.kv_heads, layer.head_dim_k, layer.head_dim_v)
            elif layer.kind == "chunked":
                layer = LayerKV("chunked", layer.kv_heads, layer.head_dim_k, layer.head_dim_v, LLAMA4_CHUNK)
            layers.append(layer)
        return replace(g, layers=tuple(layers))

    def replicated(self, stored: KVGeometry) -> bool:
        return True  # a GPU holds whole layers

    def check_split(self, q: KVQuestion) -> None:
        pass  # layers are split over GPUs, not heads: any number of GPUs works

    def gpu_layers(self, stored: KVGeometry, tp: int) -> tuple[LayerKV, ...]:
        """The layers of the GPU with the most KV: llama.cpp gives each GPU an even run of layers."""
        if tp <= 1:
            return stored.layers
        n = len(stored.layers)
        bounds = [round(i * n / tp) for i in range(tp + 1)]
        runs = [stored.layers[a:b] for a, b in zip(bounds, bounds[1:])]
        return max(runs, key=lambda run: sum(layer.elements_per_token for layer in run))

    def cells(self, q: KVQuestion, n_ctx: int | None = None) -> tuple[int, int, int]:
        """(streams, cells per stream, window cells per stream) llama-server allocates for the question:
        ``-c`` of ``n_ctx`` (default batch x context) and ``-np`` of ``q.batch``."""
        unified = bool(q.options.get("unified"))
        asked = n_ctx or q.context * q.batch
        n_ctx = round_up(asked, PAD)
        streams = 1 if unified else q.batch
        cells = round_up(n_ctx // streams, PAD)
        ubatch = min(asked, UBATCH)
        windows = [layer.span for layer in self.stored(q).kv_layers if layer.kind != "full" and layer.span]
        swa = round_up(min(cells, max(windows) * (q.batch if unified else 1) + ubatch), PAD) if windows else 0
        return streams, cells, swa

    def answer(self, q: KVQuestion, n_ctx: int | None = None) -> KVAnswer:
        self.check(q)
        stored, dtype = self.stored(q), self.resolve_dtype(q)
        streams, cells, swa = self.cells(q, n_ctx)
        total = sum(self.layer_bytes_per_token(stored, layer, dtype, q.tp) * streams * (cells if layer.kind == "full" else swa)
                    for layer in self.gpu_layers(stored, q.tp) if layer.stores)
        note = f"{streams} stream(s) of {cells} cells (n_ctx padded to 256)"
        if swa:
            note += f", window cache of {swa} cells"
        if stored.mla:
            note += "; MLA latent, K only"
        elif q.geometry.mla:
            note += "; MLA decompressed"
        if q.tp > 1:
            note += f"; layers split over {q.tp} GPUs (the GPU with the most KV)"
        return KVAnswer(self.engine, dtype, total, streams * cells, streams * swa, self.bytes_per_token(q), note)

    def deployment(self, q: KVQuestion, limit: int) -> KVAnswer:
        """llama-server allocates its whole cache at start: ``-c limit x slots -np slots`` gives every slot
        the limit, whatever the requests' typical length; with a unified cache (``-kvu``) the slots share
        n_ctx cells, which must hold one request at the limit and the slots at their typical length."""
        limit = max(limit, q.context)
        if q.options.get("unified"):
            a = self.answer(q, n_ctx=max(limit, q.context * q.batch))
            return a if limit <= q.context * q.batch else \
                KVAnswer(a.engine, a.dtype, a.bytes_per_gpu, a.tokens_full, a.tokens_windowed, a.bytes_per_token,
                         f"{a.note}; unified: one request at the {limit:,}-token limit")
        a = self.answer(replace(q, context=limit))
        if limit == q.context:
            return a
        return KVAnswer(a.engine, a.dtype, a.bytes_per_gpu, a.tokens_full, a.tokens_windowed, a.bytes_per_token,
                        f"{a.note}; every one of the {q.batch} slot(s) allocated at the {limit:,}-token limit "
                        f"(-c {limit * q.batch} -np {q.batch}), not the typical {q.context:,}")

    def serving_dtype(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        """The weights of the GGUF llama.cpp's converter makes from an HF checkpoint (convert_hf_to_gguf.py
        --outtype auto: bf16 for a bf16 checkpoint, f16 otherwise). The KV is :meth:`auto_dtype`'s f16."""
        return "bf16" if geometry.dtype == "bf16" else "fp16"

    def serving_note(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        return (f"llama.cpp: the GGUF's own tensors (converted from the config's {geometry.dtype or 'none'} with "
                f"--outtype auto: {self.serving_dtype(geometry)}); KV --cache-type-k/-v f16")

    kv_lever_dtypes = ("q8_0", "q4_0")
    # GGUF weight types with their block scales (ggml: Q8_0 34 bytes per 32 weights, Q4_0 18 per 32)
    weight_formats: ClassVar[dict[str, float]] = {"q8_0": 34 / 32, "q4_0": 18 / 32}

    def kv_dtype_flag(self, dtype: str) -> str:
        return f"-ctk {dtype} -ctv {dtype}"

    def weights_flag(self, fmt: str) -> str:
        return f"a {fmt.upper()} GGUF (llama-quantize)"

    def limit_flag(self, limit: int, batch: int) -> str:
        return f"-c {limit * batch} -np {batch}"

    def concurrency_flag(self, batch: int) -> str:
        return f"-np {batch}"

    def host_memory(self, q: KVQuestion) -> list[tuple[str, float, str]]:
        """What llama-server holds in host RAM beyond its pool:

        - its prompt cache: idle slots' states saved up to --cache-ram MiB (8192 by default, as its log says:
          "prompt cache is enabled, size limit: 8192 MiB"), grown by distinct prompts (1.1 GiB after the CPU
          default run's cells, with a 720 MiB pool). Counted at its limit: nothing else bounds it;
        - its output buffer: a row of n_vocab float logits a slot (llama-context.cpp output_reserve:
          max(outputs, n_seq_max) rows; logged "CPU output buffer size");
        - the sampler each running request is given (server-context.cpp common_sampler_init as a task takes its
          slot), whose candidates common/sampling.cpp set_logits resizes to n_vocab llama_token_data of 12 bytes.
        On the embedded model the last two are 0.75 MiB a slot. The reserve graph's growth with the cells, the
        HTTP threads (slots + 4) and their heaps are not counted."""
        try:
            mib = int(q.options.get("cache_ram_mib", CACHE_RAM_MIB))
        except (TypeError, ValueError):
            raise KVRuleError(f"cache_ram_mib takes a whole number of MiB, not {q.options['cache_ram_mib']!r}") from None
        terms = []
        if mib > 0:
            given = "cache_ram_mib" in q.options
            terms.append(("prompt cache", mib * 2**20, f"llama-server's prompt cache in host RAM, at its limit: "
                          f"--cache-ram {mib} MiB{'' if given else ' (its default)'}; it grows with distinct prompts "
                          "(--cache-ram 0 turns it off)"))
        vocab, slots = q.geometry.vocab_size, max(1, q.batch)
        if vocab:
            terms += [("output buffer", slots * vocab * 4, f"{slots} slot(s) x a row of {vocab:,} float logits "
                                                           "(llama-context.cpp output_reserve)"),
                      ("sampler candidates", slots * vocab * 12, f"{slots} running request(s) x {vocab:,} candidates "
                                                                 "of 12 bytes (common/sampling.cpp set_logits)")]
        else:
            terms.append(("output buffer and samplers", 0, "not counted: a slot's row of logits and its sampler's "
                                                           "candidates (the model's files name no vocabulary size)"))
        return terms

    def host_levers(self) -> list[tuple[str, dict]]:
        return [("--cache-ram 0", {"cache_ram_mib": 0}), ("--cache-ram 1024", {"cache_ram_mib": 1024})]

    def tp_flag(self, tp: int) -> str:
        return f"{tp} GPUs (--split-mode layer)"

    def sequences_in_pool(self, geometry: KVGeometry, pool_tokens: int, context: int, details: dict) -> int | None:
        """Each slot (-np: the log's "N/N seqs") serves one sequence at a time, from its own stream of cells
        (n_ctx / slots without a unified cache) or the one unified stream, a sequence's cells padded to 256:
        at most the slots, fewer where a stream holds fewer sequences (none where one does not fit). Without
        the logged caches (details["caches"]): the pool's tokens, one slot each."""
        caches = details.get("caches") or []
        padded = round_up(context, PAD)
        if not caches:
            return pool_tokens // padded
        full = max(caches, key=lambda c: c["cells"] * c["streams"])  # the full-attention cache
        return min(int(full["seqs"]), int(full["streams"]) * (int(full["cells"]) // padded))

    # --- speculative decoding (tools/server/server-context.cpp, common/speculative.cpp) -------------------------
    SPEC_TYPES = {"ngram": "ngram-simple", "draft": "draft-simple", "eagle": "draft-eagle3", "mtp": "draft-mtp"}

    def speculative_flag(self, spec) -> str | None:
        flag = f"--spec-type {self.SPEC_TYPES[spec.method]}"
        if spec.method in ("draft", "eagle"):
            flag += f" --model-draft {spec.draft_name or 'HEAD.gguf'}"
        return flag + (f" --spec-draft-n-max {spec.tokens}" if spec.tokens and spec.method != "ngram" else "")

    def draft_kv(self, q: KVQuestion, spec, limit: int) -> DraftKV:
        """llama-server makes the drafter a context of its own (common/speculative.cpp
        common_speculative_init_result: ``cparams.n_ctx = llama_n_ctx(ctx_tgt)``, "the draft context holds as
        many tokens per sequence as the target context"), with the target's slots and unified switch
        (common_base_params_to_speculative copies them) and its own cache types (``--cache-type-k-draft`` /
        ``-v-draft``, f16 by default): a second KV cache of the same cells, and its own compute buffer. An MTP
        context (draft-mtp) runs on the target's weights (LLAMA_CONTEXT_TYPE_MTP): its cache is read here as the
        MTP layers', unverified."""
        if spec.method == "ngram":
            return ngram_kv("llama.cpp: common/ngram-*.cpp over the slot's tokens")
        dtype = str(q.options.get("draft_kv_dtype") or "f16")
        dq = replace(q, geometry=spec.draft, dtype=dtype)
        a = self.deployment(dq, limit)
        terms = ()
        if q.device == "gpu" and spec.widths is not None:  # the draft context's own reserve graph
            sq = StartupQuestion(replace(dq, context=max(limit, q.context)), limit, "", 0.0, 0.0, "", 0.0,
                                 spec.widths, q.batch)
            buf = gpumem.compute_buffer(sq, a.tokens_full)
            terms = (("draft compute buffer", buf.bytes, f"the draft context's: {buf.source}"),)
        mtp = spec.method == "mtp"
        return DraftKV("its own context: a second KV cache of the same cells", a.bytes_per_token, a.bytes_per_gpu,
                       f"the draft context's cache: {a.note}; K/V {a.dtype} (--cache-type-k-draft/-v-draft"
                       f"{'' if 'draft_kv_dtype' in q.options else ', f16 by default'})"
                       + ("; unverified: the MTP context's cache is read as the MTP layers' (no MTP GGUF ran here)"
                          if mtp else ""), verified=not mtp, terms=terms)

    # --- its memory on a GPU at startup (gpumem.py) -------------------------------------------------------
    def startup_memory(self, q):
        return gpumem.startup_memory(self, q)

    def startup_refusal(self, q, mem, available: float, one_request: float, longest: int):
        return gpumem.startup_refusal(self, q, available, one_request, longest)

