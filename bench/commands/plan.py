"""`kvbench plan`: will a deployment fit, and what should change (the verdict line first, then the ledger per
GPU and the levers, best first). Every numeric option is read here, so that bad input is one line, exit 2."""
import json
import math
from dataclasses import asdict

import typer
from rich.markup import escape
from rich.table import Table

from kvbench.common import ui
from kvbench.common.suggest import hint, with_hint
from kvbench.kv.geometry import KV_DTYPE_BYTES
from kvbench.kv.units import GIB, fmt_bytes, fmt_gib
from kvbench.planner import (
    NODE_GPUS,
    WEIGHT_DTYPES,
    PlanError,
    PlanInput,
    catalog_names,
    similar_model,
    engine_rules,
    engines,
    gpu_catalog,
    lever_line,
    measured_overhead,
    parse_bytes,
    parse_float,
    parse_int,
    parse_tokens,
    plan,
    resolve_model,
    setup,
)
from kvbench.planner.capacity import engine_pools
from kvbench.kv.model_config import ConfigError

EXIT_UNVERIFIED = 3  # --strict and a config with per-layer keys the reader did not read


def _kv_dtypes_help() -> str:
    per = [f"{e}: auto, {', '.join(sorted(engine_rules(e).dtypes))}" for e in engines()]
    return ("KV cache dtype. auto (default) is each engine's own: the model dtype as the engine serves it (vLLM "
            "serves a float32 config in bf16), f16 for llama.cpp, fp8 where a quantised checkpoint's config asks "
            f"for it. Without --engine: auto, {', '.join(sorted(KV_DTYPE_BYTES))}. Per engine: {'; '.join(per)}.")


def _engine_options_help() -> str:
    per = [f"{e}: {', '.join(engine_rules(e).rule_options)}" for e in engines() if engine_rules(e).rule_options]
    return f"KEY=VALUE for the engine's rules (repeat for several); keys: {'; '.join(per)}."


KV_DTYPES_HELP = _kv_dtypes_help()
ENGINE_OPTIONS_HELP = _engine_options_help()


def plan_command(
    model: str = typer.Argument(..., help="A config.json, a model folder, a GGUF file, a hub id (org/name), the "
                                          "embedded model (smollm2) or a catalog name: "
                                          f"{', '.join(catalog_names())}."),
    context: str = typer.Option(None, "--context", "-n", metavar="TOKENS",
                                help="The typical request's tokens (prompt + output), e.g. 10000 or 10k "
                                     "(default: the limit). Suffixes as vLLM's: k = 1,000, K = 1,024, m, M."),
    max_model_len: str = typer.Option(None, "--max-model-len", metavar="TOKENS",
                                      help="The per-request limit the server is started with (vLLM "
                                           "--max-model-len, llama.cpp -c / -np, TGI --max-total-tokens); default: "
                                           "the model's, RoPE scaling included (Qwen2.5 with YaRN factor 4: 131,072)."),
    # no -b: that is --backend in run, setup and validate
    batch: str = typer.Option("1", "--batch", metavar="N", help="Requests served at once."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help=KV_DTYPES_HELP),
    tp: str = typer.Option("1", "--tp", metavar="N",
                           help="GPUs the model is split over (tensor parallel; llama.cpp splits layers)."),
    pp: str = typer.Option("1", "--pp", metavar="N",
                           help="Pipeline stages, each on its own --tp GPUs holding its layers and their KV (vLLM "
                                "--pipeline-parallel-size, SGLang --pp-size); may span nodes."),
    dp: str = typer.Option("1", "--dp", metavar="N",
                           help="Data-parallel attention over N GPUs for an MLA model (vLLM --data-parallel-size N "
                                "--enable-expert-parallel, SGLang --enable-dp-attention): each GPU holds the KV of "
                                "its share of the batch, the routed experts split over all."),
    engine: str = typer.Option(None, "--engine", help=f"Apply this engine's rules: {', '.join(engines())} "
                                                      "(default: the plain formula)."),
    gpu: str = typer.Option(None, "--gpu", help=f"A GPU: {', '.join(gpu_catalog())}; or a size such as 48GiB."),
    memory: str = typer.Option(None, "--memory", metavar="SIZE",
                               help="Instead of a GPU, a CPU memory wall of SIZE (1G, 1.5GiB): the engine's whole "
                                    "process tree in a memory cgroup, as `kvbench run --memory-limit SIZE` starts "
                                    "it. Implies --device cpu and --margin 0; the engine's host caches count."),
    block_size: str = typer.Option(None, "--block-size", metavar="N",
                                   help="The engine's KV block size (default: its own; vLLM 16 on a GPU, 128 on a "
                                        "CPU; TGI 1). Engines with blocks: vllm, tgi."),
    device: str = typer.Option(None, "--device", help="gpu or cpu: the device the engine runs on (vLLM sizes "
                                                       "blocks per device; the overhead is measured per device); "
                                                       "default gpu, cpu with --memory."),
    engine_version: str = typer.Option(None, "--engine-version", help="The engine's version, where its rules "
                                                                      "changed (default: the version kvbench runs)."),
    engine_option: list[str] = typer.Option([], "--engine-option", help=ENGINE_OPTIONS_HELP),
    weights_dtype: str = typer.Option("auto", "--weights-dtype",
                                      help=f"The weights' width: {', '.join(WEIGHT_DTYPES)}. auto (default): the "
                                           "checkpoint's own, an unquantised one at the engine's serving dtype."),
    weights_bytes: str = typer.Option(None, "--weights-bytes", metavar="SIZE",
                                      help="The weights' size, all GPUs, overriding every other source: 61GiB, "
                                           "65.5GB, 688586727753 (bytes)."),
    overhead_gib: str = typer.Option(None, "--overhead-gib", metavar="GIB",
                                     help="Runtime overhead per GPU (CUDA context, activations, graphs); default: "
                                          "the engine's measured on the device (the table kvbench ships from its "
                                          "published runs), else 1.5, an assumption."),
    overhead_from: str = typer.Option(None, "--overhead-from", metavar="RUN",
                                      help="Take the overhead per GPU a GPU run measured (its largest over the cells "
                                           "of --engine, if given) instead of the shipped table's."),
    margin: str = typer.Option(None, "--margin", metavar="FRACTION",
                               help="Fraction of the memory kept free, from 0 to below 1 (default 0.10 of a GPU, "
                                    "0 of a --memory wall, which is exact)."),
    node_gpus: str = typer.Option(str(NODE_GPUS), "--node-gpus", metavar="N",
                                  help="GPUs in a node: the most the tensor-parallel lever proposes."),
    allow_long_context: bool = typer.Option(False, "--allow-long-context",
                                            help="Plan a limit beyond the model's own."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="Read a remote-code model's configuration_*.py (shipped in its "
                                                "folder) through transformers' AutoConfig: runs that file."),
    strict: bool = typer.Option(False, "--strict", help=f"Exit {EXIT_UNVERIFIED} when the config has per-layer "
                                                         "keys the reader did not read (not verified)."),
    shared_prefix: str = typer.Option(None, "--shared-prefix", metavar="TOKENS",
                                      help="Every request of the batch starts with the same TOKENS (a system "
                                           "prompt, a document): the KV the batch holds in use with the prefix "
                                           "shared at the engine's granularity (vLLM's blocks; engines that do "
                                           "not share hold a copy each). The pool and verdict are unchanged."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    compare_engines: bool = typer.Option(False, "--compare-engines",
                                         help="Every engine's KV pool side by side for this model and GPU (or "
                                              "wall), at the limit: the tokens and requests each engine's rules "
                                              "make of the memory the weights and its overhead leave (each "
                                              "engine's auto KV dtype). Not with --engine."),
):
    """Will a deployment fit on a GPU (or in a CPU memory wall), and what should change: the verdict first, the
    ledger per GPU, the levers."""
    try:
        options = _engine_options(engine_option)
        wall = parse_bytes(memory, "--memory")
        device = device or ("cpu" if wall is not None else "gpu")
        _check_choices(engine, device, weights_dtype)
        _check_engine_options(engine, options)
        overhead = _finite(parse_float(overhead_gib, "--overhead-gib"), "--overhead-gib")
        if overhead_from is not None and overhead is not None:
            raise PlanError("--overhead-gib and --overhead-from: give one")
        source = "given: --overhead-gib"
        if overhead_from is not None:
            found = measured_overhead(overhead_from, engine)
            overhead, source = found.fixed_bytes / GIB, found.source
        if compare_engines and engine:
            raise PlanError("--compare-engines sets every engine side by side: not with --engine")
        _check_model_name(model)
        m = resolve_model(model, weights_dtype, trust_remote_code, parse_bytes(weights_bytes, "--weights-bytes"))
        p = PlanInput(
            model=m, context=parse_tokens(context, "--context"), batch=parse_int(batch, "--batch"),
            kv_dtype=kv_dtype, tp=parse_int(tp, "--tp"), pp=parse_int(pp, "--pp"), dp=parse_int(dp, "--dp"), engine=engine.lower() if engine else None, gpu=gpu,
            overhead_gib=overhead, overhead_source=source, memory=wall,
            margin=_finite(parse_float(margin, "--margin"), "--margin") if margin is not None else (0.0 if wall is not None else None), block_size=parse_int(block_size, "--block-size", 0),
            device=device, engine_version=engine_version, engine_options=options,
            allow_long_context=allow_long_context, max_model_len=parse_tokens(max_model_len, "--max-model-len"),
            node_gpus=parse_int(node_gpus, "--node-gpus"),
            shared_prefix=parse_tokens(shared_prefix, "--shared-prefix"))
        if compare_engines:
            s = setup(p)
            if s.gpu is None:
                raise PlanError("--compare-engines needs a GPU (--gpu) or a memory wall (--memory)")
            if s.weights.bytes is None:
                raise PlanError("--compare-engines needs the weights' size: give --weights-bytes")
            pools = engine_pools(s, engines())
        else:
            result = plan(p)
    except (PlanError, ConfigError) as exc:
        message = str(exc)
        if model in message and (near := similar_model(model, catalog_names())):  # its family and size only
            at = message.find("; catalog:")
            h = f"did you mean {near!r}?"
            message = f"{message[:at]}; {h} {message[at + 2:]}" if at >= 0 else f"{message}; {h}"
        if engine and engine in str(exc):
            message = with_hint(message, engine, engines())
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2)
    if compare_engines:
        _print_pools(s, pools, as_json)
        if strict and not m.verified:
            raise typer.Exit(EXIT_UNVERIFIED)
        return
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    if strict and not result["verified"]:
        raise typer.Exit(EXIT_UNVERIFIED)


def _print(r: dict) -> None:
    v = r["verdict"]
    typer.echo(r["asked"]["line"])  # the question asked, answered first; then what the limit implies
    typer.echo(r["at_limit"]["line"])
    if r.get("startup") and r["gpu"]:
        typer.echo(f"  {v['line']}")
    if r["at_asked_limit"]:
        typer.echo(r["at_asked_limit"]["line"])
    wall = r.get("memory_wall")
    on = r["gpu"] if wall else f"{r['gpus']} x {r['gpu']}{_layout(r)}" if r.get("gpu") else "no GPU given"
    typer.echo(f"{r['model']} under {r['engine']} on {on}: {r['batch']} at once of {r['context']:,} tokens "
               f"(typical), a limit of {r['max_model_len']:,} per request ({r['max_model_len_source']}; "
               f"{r['limit_flag']}); KV {r['kv_dtype']} ({r['kv_dtype_source']})")
    per = "In the wall" if wall else "Per GPU"
    t = Table(title=f"{per}: {escape(r['model'])}", show_header=True)
    t.add_column("term")
    t.add_column("in the wall" if wall else "per GPU", justify="right")
    t.add_column("from")
    for row in r["ledger"]:
        t.add_row(row["term"], fmt_gib(row["bytes"], "unknown"), escape(row["source"]))
    if r.get("gpu"):
        t.add_row("= total", fmt_gib(r["needed_bytes_per_gpu"] + r["kept_free_bytes"]
                                     if r["needed_bytes_per_gpu"] is not None else None, "unknown"),
                  f"of {r['gpu']}" if wall else
                  f"of {r['gpu']}'s {fmt_gib(r['gpu_memory_bytes'])} ({fmt_gib(r['usable_bytes'])} usable)")
    ui.console().print(t)
    if shared := r.get("shared_prefix"):
        where = "in the wall" if wall else "per GPU"
        typer.echo(f"With the first {shared['tokens']:,} tokens of every request shared: KV in use "
                   f"{fmt_bytes(shared['kv_bytes_per_gpu'])} {where} for the batch at its typical length "
                   f"({fmt_bytes(shared['kv_bytes_per_gpu_unshared'])} unshared); {shared['rule']}. The ledger "
                   "plans every request at full length, as a pool is sized.")
    fixes = [lv for lv in r["levers"] if lv["fix"]]
    if fixes:
        typer.echo("What to change (best first):")
        for i, lv in enumerate(fixes, 1):
            typer.echo(f"  {i}. {lv['change']}: {lever_line(lv)} [{lv['what']}]")
    others = [lv for lv in r["levers"] if not lv["fix"]]
    if others:
        typer.echo("Not a fix (another question answered):")
        for lv in others:
            typer.echo(f"  - {lv['change']} ({lv['not_a_fix']}): {lever_line(lv)} [{lv['what']}]")
    d = Table(title="The model as read", show_header=False)
    d.add_row("attention", escape(r["geometry"]))
    for note in r["notes"]:
        d.add_row("read", escape(note))
    if r["unread_keys"]:
        d.add_row("not read", escape(", ".join(r["unread_keys"])))
    d.add_row("KV per token", f"{r['kv_bytes_per_token_stored'] / r['tp']:,.0f} B{'' if wall else ' per GPU'} as stored "
              f"({r['kv_dtype']}{'; ' + escape(r['kv_scope']) if r['kv_scope'] else ''})")
    d.add_row("serving dtype", f"{r['serving_dtype']} ({escape(r['serving_dtype_source'])})")
    ui.console().print(d)


def _layout(r: dict) -> str:
    """How the GPUs are split, where more than one is."""
    parts = [f"tensor parallel {r['tp']}"] if r["tp"] > 1 else []
    parts += [f"{r['pp']} pipeline stages"] if r["pp"] > 1 else []
    parts += [f"attention data-parallel over {r['dp']}"] if r["dp"] > 1 else []
    return f" ({', '.join(parts)})" if parts else ""


def _print_pools(s, pools, as_json: bool) -> None:
    """The engines' pools side by side (--compare-engines)."""
    on = s.gpu.name if s.gpu.wall else f"{s.tp} x {s.gpu.name}"
    if as_json:
        print(json.dumps({"model": s.model.name, "gpu": s.gpu.name, "tp": s.tp, "max_model_len": s.limit,
                          "margin": s.margin, "engines": [asdict(p) for p in pools]}, indent=2, default=str))
        return
    typer.echo(f"{s.model.name} on {on}, a limit of {s.limit:,} tokens per request ({s.limit_source}); "
               f"{s.margin:.0%} of the memory kept free")
    t = Table(title=f"KV pool per engine: {escape(s.model.name)}", show_header=True)
    for col in ("engine", "KV dtype", "bytes/token per GPU", "KV budget per GPU", "pool tokens",
                f"requests of {s.limit:,} at once", "pool sized", "how the engine stores it"):
        t.add_column(col, justify="right" if col[0] in "bKpr" and col != "pool sized" else "left")
    for p in pools:
        t.add_row(p.engine, p.kv_dtype, f"{p.bytes_per_token:,.0f}", fmt_gib(p.budget), f"{p.tokens:,}",
                  f"{p.sequences:,}", p.sized, escape(p.note))
    ui.console().print(t)
    sources = {p.overhead_source.split(";")[0] for p in pools}
    overhead = (f"every engine's {sources.pop()}" if len(sources) == 1 else
                "; ".join(f"{p.engine}'s {p.overhead_source.split(';')[0]}" for p in pools))
    typer.echo(f"KV budget: the usable memory less each engine's weights (as it serves them) and overhead "
               f"({overhead}). Measured pools: `kvbench report` of a run (its KV and boundary tables).")


def _engine_options(given: list[str]) -> dict:
    """--engine-option KEY=VALUE pairs; the run's option parser (and pydantic, 0.2 s) imported only when given."""
    if not given:
        return {}
    from kvbench.run.backend_config import ConfigError as OptionsError, parse_options

    try:
        return parse_options(",".join(given), "--engine-option")
    except OptionsError as exc:
        raise PlanError(str(exc)) from None


def _finite(value: float | None, option: str) -> float | None:
    """A number option that is a number: nan and inf parse as floats but compare false with every bound."""
    if value is not None and not math.isfinite(value):
        raise PlanError(f"{option} takes a finite number, not {value}")
    return value


def _check_model_name(model: str) -> None:
    """A model argument that is neither a path nor a valid hub id, refused before any hub request."""
    from kvbench.common.models import ModelError, check_model_name

    try:
        check_model_name(model)
    except ModelError as exc:
        raise PlanError(str(exc)) from None


def _check_choices(engine: str | None, device: str, weights_dtype: str) -> None:
    if engine is not None and engine.lower() not in engines():
        raise PlanError(f"no KV rules for engine {engine!r}; known: {', '.join(engines())}")
    if device not in ("gpu", "cpu"):
        raise PlanError(f"--device is gpu or cpu, not {device!r}")
    if weights_dtype not in WEIGHT_DTYPES:
        raise PlanError(f"unknown --weights-dtype {weights_dtype!r}; known: {', '.join(WEIGHT_DTYPES)}")


def _check_engine_options(engine: str | None, options: dict) -> None:
    """--engine-option keys the engine's KV rules read (their ``rule_options``), not silently ignored."""
    if not options:
        return
    if engine is None:
        raise PlanError(f"--engine-option {', '.join(options)} needs --engine (the plain formula takes none)")
    allowed = engine_rules(engine).rule_options
    for key in options:
        if key not in allowed:
            raise PlanError(f"unknown --engine-option {key!r} for {engine}; {hint(key, allowed)}"
                            f"allowed: {', '.join(allowed) or 'none'}")
