"""The CUDA side of ``python -m kvbench.selfcheck.gpu_check`` (run by an interpreter whose torch sees the GPU, e.g. the hf
environment's). It talks with the parent over stdin/stdout: at each step it prints one JSON line and waits
for a line on stdin, so the parent reads NVML while this process holds exactly what the step says.

    python gpu_probe.py info
    python gpu_probe.py alloc --bytes N
    python gpu_probe.py kv (--model DIR | --config JSON_FILE) --cells 1024x1,4096x4 --new 16 [--dtype bf16]
      (--config: a random-weight model of that config, built on the GPU)
    python gpu_probe.py kvquant (--model DIR | --config JSON_FILE) --caches JSON --prompt N --new M
      [--requests R] [--top K] [--device cuda|cpu] [--torch-unpack]
      (the KV-quantisation step: one generate per request and cache, {"name": cache_config or null}; events
      without waiting on stdin: ready, kvq_cell per cache, done; --device cpu: the same code on a CPU)
    python gpu_probe.py bandwidth [--bytes N] [--device cuda|cpu]
      (the device's memory bandwidth: one event, no waiting; what a run records on a GPU, the decode bound's
      denominator: docs/metrics.md "Decode bound")

Events (one JSON object a line, ``event`` first): info; ready (CUDA context up, nothing allocated);
allocated / freed (alloc); loaded, cell_before, cell_after, cell_freed, cell_error (kv); done.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def emit(event: str, wait: bool = True, **fields):
    print(json.dumps({"event": event, **fields}), flush=True)
    if wait:
        line = sys.stdin.readline()
        if not line or line.strip() == "stop":
            sys.exit(0)


def allocator() -> dict:
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "max_allocated": torch.cuda.max_memory_allocated()}


def info() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
        out["device_total"] = torch.cuda.get_device_properties(0).total_memory
    return out


def cmd_alloc(args):
    torch.zeros(1, device="cuda")  # the CUDA context: NVML sees it, the allocator does not
    emit("ready", **allocator())
    block = torch.empty(args.bytes, dtype=torch.uint8, device="cuda")
    block.fill_(1)  # touch every page
    emit("allocated", requested=args.bytes, **allocator())
    del block
    torch.cuda.empty_cache()
    emit("freed", **allocator())
    emit("done", wait=False)


def cmd_kv(args):
    from hf_worker import CACHE_KWARG, cache_bytes
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.zeros(1, device="cuda")
    emit("ready", **allocator())
    if args.config:
        values = json.load(open(args.config))
        values.pop("quantization_config", None)  # random weights in the asked dtype: nothing to dequantize
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        torch.manual_seed(0)
        with torch.device("cuda"):  # built on the GPU: random weights, no copy through the CPU
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to("cuda").eval()
    vocab = model.config.get_text_config().vocab_size
    # one short generate first: the first call allocates cuBLAS's workspace and loads kernels (tens of MiB the
    # allocator keeps), which would otherwise be counted in the first cell's delta
    warm = torch.randint(3, vocab, (1, 16), device="cuda")
    with torch.inference_mode():
        model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    torch.cuda.empty_cache()
    emit("loaded", **allocator())
    generator = torch.Generator().manual_seed(0)
    for cell in args.cells.split(","):
        prompt, batch = (int(x) for x in cell.split("x"))
        ids = torch.randint(3, vocab, (batch, prompt), generator=generator).to("cuda")
        mask = torch.ones_like(ids)
        torch.cuda.empty_cache()  # reserved ~ allocated before the cell, so NVML's delta is the cell's
        before = allocator()
        torch.cuda.reset_peak_memory_stats()
        emit("cell_before", prompt=prompt, batch=batch, **before)
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                               do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache})
        except torch.cuda.OutOfMemoryError as exc:
            del cache
            torch.cuda.empty_cache()
            emit("cell_error", prompt=prompt, batch=batch, error=f"CUDA out of memory: {str(exc)[:300]}")
            continue
        seconds = time.perf_counter() - t0
        after = allocator()  # the cache is the only allocation of this cell still alive
        torch.cuda.empty_cache()  # drop the activations' cached blocks: what NVML then sees is the cache
        trimmed = allocator()
        kv_bytes, seq = cache_bytes(cache)
        emit("cell_after", prompt=prompt, batch=batch, new=args.new, seconds=seconds, cache_bytes=kv_bytes,
             cache_seq_len=seq, allocated=after["allocated"], reserved_before_trim=after["reserved"],
             reserved=trimmed["reserved"], max_allocated=after["max_allocated"])
        del cache
        torch.cuda.empty_cache()
        emit("cell_freed", prompt=prompt, batch=batch, **allocator())
    emit("done", wait=False)


def torch_unpack(device_type: str) -> None:
    """Serve quanto's unpack on ``device_type`` by quanto's own torch implementation (library/unpack.py, the
    "default" kernel): its CUDA kernel is a JIT-compiled extension (nvcc; AWQ and Marlin kernels built with
    it) that would take the check's time. The packed layout, and so the bytes held, is the same."""
    import optimum.quanto  # noqa: F401  registers quanto::unpack and its device kernels

    def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:  # optimum-quanto 0.2.7 library/unpack.py
        return torch.cat([(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]).to(torch.uint8)

    global _UNPACK_LIB
    _UNPACK_LIB = torch.library.Library("quanto", "IMPL")
    _UNPACK_LIB.impl("unpack", unpack, device_type.upper())


_UNPACK_LIB = None


def cmd_kvquant(args):
    from hf_worker import CACHE_KWARG, Worker, cache_bytes
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, QuantizedCache

    device = args.device
    cuda = device == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.torch_unpack:
        torch_unpack(device)
    if cuda:
        torch.zeros(1, device="cuda")
    if args.config:
        values = json.load(open(args.config))
        values.pop("quantization_config", None)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    emit("ready", wait=False, **(allocator() if cuda else {}))
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (1, args.prompt), generator=generator).to(device) for _ in range(args.requests)]
    text_config = model.config.get_text_config(decoder=True)
    for name, setting in json.loads(args.caches).items():
        requests, held, seconds, deltas = [], [], 0.0, []
        try:
            for ids in prompts:
                if setting:
                    setting = dict(setting)
                    cache = QuantizedCache(backend=setting.pop("backend", "quanto"), config=text_config, **setting)
                else:
                    cache = DynamicCache(config=model.config)
                if cuda:
                    torch.cuda.empty_cache()
                    before = allocator()["allocated"]
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                         min_new_tokens=args.new, do_sample=False, pad_token_id=0,
                                         output_logits=True, return_dict_in_generate=True, **{CACHE_KWARG: cache})
                seconds += time.perf_counter() - t0
                tokens, top = Worker.top_logprobs_of(out, 0, args.prompt, args.new, args.top)
                logits = out.logits
                del out, logits
                if cuda:
                    deltas.append(allocator()["allocated"] - before)  # the cache is what is left of the call
                held.append(cache_bytes(cache))
                requests.append({"tokens": tokens, "top": top})
                del cache
        except Exception as exc:  # one cache that fails is its own row
            emit("kvq_cell", wait=False, kv_dtype=name, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        emit("kvq_cell", wait=False, kv_dtype=name, cache_bytes=[b for b, _ in held], cache_seq_len=held[0][1],
             allocator_delta=deltas or None, seconds=seconds, requests=requests)
    emit("done", wait=False)


def cmd_bandwidth(args):
    """The device's read bandwidth (a sum over a buffer far past its caches: decode reads, and writes almost
    nothing) and its copy bandwidth (bytes read and written), each the best of a few rounds of several passes."""
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    data = torch.ones(args.bytes // 4, dtype=torch.float32, device=device)
    copy = torch.empty_like(data)

    def best_seconds(step) -> float:
        step(), sync()  # the kernels' first launch
        rounds = []
        for _ in range(args.rounds):
            sync()
            start = time.perf_counter()
            for _ in range(args.passes):
                step()
            sync()
            rounds.append((time.perf_counter() - start) / args.passes)
        return min(rounds)

    read_s = best_seconds(data.sum)
    copy_s = best_seconds(lambda: copy.copy_(data))
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    emit("bandwidth", wait=False, device=name, array_bytes=data.nbytes, read_bytes_per_s=data.nbytes / read_s,
         copy_bytes_per_s=2 * data.nbytes / copy_s, rounds=args.rounds, passes=args.passes, torch=torch.__version__,
         method=f"torch on {device}: a float32 sum (read) and a copy (read + write) of {data.nbytes / 2**30:.2f} GiB, "
                f"best of {args.rounds} rounds of {args.passes} passes")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info")
    a = sub.add_parser("alloc")
    a.add_argument("--bytes", type=int, required=True)
    k = sub.add_parser("kv")
    source = k.add_mutually_exclusive_group(required=True)
    source.add_argument("--model")
    source.add_argument("--config")
    k.add_argument("--cells", required=True, help="PROMPTxBATCH,...")
    k.add_argument("--new", type=int, default=16)
    k.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    q = sub.add_parser("kvquant")
    source = q.add_mutually_exclusive_group(required=True)
    source.add_argument("--model")
    source.add_argument("--config")
    q.add_argument("--caches", required=True, help='{"bf16": null, "quanto-int4": {"backend": "quanto", ...}}')
    q.add_argument("--prompt", type=int, default=2048)
    q.add_argument("--new", type=int, default=32)
    q.add_argument("--requests", type=int, default=2)
    q.add_argument("--top", type=int, default=20)
    q.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    q.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    q.add_argument("--torch-unpack", action="store_true", help="quanto's torch unpack on the device, not its JIT kernel")
    b = sub.add_parser("bandwidth")
    b.add_argument("--bytes", type=int, default=2 << 30)
    b.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--passes", type=int, default=10)
    args = parser.parse_args()
    if args.command == "bandwidth":
        return cmd_bandwidth(args)
    if args.command == "kvquant":
        return cmd_kvquant(args)
    if args.command == "info":
        print(json.dumps(info()), flush=True)
    elif args.command == "alloc":
        cmd_alloc(args)
    else:
        cmd_kv(args)


if __name__ == "__main__":
    main()
