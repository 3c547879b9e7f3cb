"""`kvbench plan`: will a deployment fit, and what should change (the verdict line first, then the ledger per
GPU and the levers, best first). The options are declared once (bench/commands/plan_options.py): this module
makes a typer parameter of each and reads them there, so that bad input is one line, exit 2."""
import inspect
import json
from dataclasses import asdict

import typer

from kvbench.commands.plan_options import ARGUMENTS, EXIT_UNVERIFIED, plan_flags, read_plan_options
from kvbench.common.suggest import with_hint
from kvbench.kv.units import fmt_bytes, fmt_gib
from kvbench.planner import PlanError, catalog_names, engines, lever_line, plan, resolve_model, setup, similar_model
from kvbench.planner.capacity import engine_pools
from kvbench.planner.decode import decode_answer
from kvbench.kv.model_config import ConfigError
from kvbench.kv.rules import KVRuleError
from kvbench.run.option_fields import Flag


def plan_command(**given):
    """Will a deployment fit on a GPU (or in a CPU memory wall), and what should change: the verdict first, the
    ledger per GPU, the levers."""
    model = given["model"]
    try:
        o = read_plan_options(given)
        m = resolve_model(model, o.weights_dtype, o.trust_remote_code, o.weights_bytes)
        draft = resolve_model(o.draft_model, trust_remote_code=o.trust_remote_code) if o.draft_model else None
        p = o.plan_input(m, draft)
        if o.compare_engines:
            if o.bandwidth is not None:
                raise PlanError("--bandwidth answers one engine's plan, not --compare-engines")
            s = setup(p)
            if s.gpu is None:
                raise PlanError("--compare-engines needs a GPU (--gpu) or a memory wall (--memory)")
            if s.weights.bytes is None:
                raise PlanError("--compare-engines needs the weights' size: give --weights-bytes")
            compared, lacking = o.compared_engines()
            pools = engine_pools(s, compared, o.engine_options)
        else:
            result = plan(p)
            if o.bandwidth is not None:
                result["decode_bound"] = decode_answer(result, o.bandwidth, o.decode_efficiency)
    except (PlanError, ConfigError, KVRuleError) as exc:  # KVRuleError: an engine's rules refusing, in one line
        message = str(exc)
        if model in message and (near := similar_model(model, catalog_names())):  # its family and size only
            at = message.find("; catalog:")
            h = f"did you mean {near!r}?"
            message = f"{message[:at]}; {h} {message[at + 2:]}" if at >= 0 else f"{message}; {h}"
        engine = given["engine"]
        if engine and engine in message:
            message = with_hint(message, engine, engines())
        typer.echo(f"error: {one_line(message)}", err=True)
        raise typer.Exit(2)
    if o.compare_engines:
        _print_pools(s, pools, lacking, o.as_json)
        if o.strict and not m.verified:
            raise typer.Exit(EXIT_UNVERIFIED)
        return
    if o.as_json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    if o.strict and not result["verified"]:
        raise typer.Exit(EXIT_UNVERIFIED)


def one_line(message: str) -> str:
    """A refusal as one line, whatever the text it quotes holds (a vertical tab in a folder's name ends a line)."""
    return "".join(c.encode("unicode_escape").decode() if (c + "x").splitlines()[0] != c + "x" else c
                   for c in message)


def typer_parameter(flag: Flag) -> inspect.Parameter:
    """An option's flag as typer reads a parameter: an argument by position (ARGUMENTS), else an option with
    its names, metavar and help."""
    if flag.param in ARGUMENTS:
        default = typer.Argument(flag.default, help=flag.help)
    else:
        extra = {"metavar": flag.metavar} if flag.metavar is not None else {}
        default = typer.Option(flag.default, *flag.names, help=flag.help, **extra)
    return inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, annotation=flag.kind, default=default)


# typer reads the command's parameters from its signature: the plan options' flags, in their order
plan_command.__signature__ = inspect.Signature([typer_parameter(flag) for flag in plan_flags()])
plan_command.__annotations__ = {flag.param: flag.kind for flag in plan_flags()}


def _print(r: dict) -> None:
    # rich here and in _print_pools, not at the top: --json and a refusal print no table (issue 54 item 4)
    from rich.markup import escape
    from rich.table import Table

    from kvbench.common import ui

    v = r["verdict"]
    typer.echo(r["asked"]["line"])  # the question asked, answered first; then what the limit implies
    typer.echo(r["at_limit"]["line"])
    if r.get("startup") and r["gpu"]:
        typer.echo(f"  {v['line']}")
    if r["at_asked_limit"]:
        typer.echo(r["at_asked_limit"]["line"])
    if r.get("speculation"):
        typer.echo(r["speculation"]["line"])
    if "decode_bound" in r:
        typer.echo(r["decode_bound"]["line"] if r["decode_bound"] else
                   "Decode bound: not planned (the weights' size is unknown: give --weights-bytes)")
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


def _print_pools(s, pools, lacking: list[str], as_json: bool) -> None:
    """The engines' pools side by side (--compare-engines); ``lacking``: the engines left out, that have no KV
    dtype --kv-dtype."""
    on = s.gpu.name if s.gpu.wall else f"{s.tp} x {s.gpu.name}"
    if as_json:
        print(json.dumps({"model": s.model.name, "gpu": s.gpu.name, "tp": s.tp, "max_model_len": s.limit,
                          "margin": s.margin, "kv_dtype": s.kv_dtype, "engines_without_kv_dtype": lacking,
                          "engines": [asdict(p) for p in pools]}, indent=2, default=str))
        return
    from rich.markup import escape
    from rich.table import Table

    from kvbench.common import ui

    typer.echo(f"{s.model.name} on {on}, a limit of {s.limit:,} tokens per request ({s.limit_source}); the memory "
               f"each engine takes: {', '.join(f'{p.engine} {p.share}' for p in pools)}")
    t = Table(title=f"KV pool per engine: {escape(s.model.name)}", show_header=True)
    for col in ("engine", "KV dtype", "bytes/token per GPU", "KV budget per GPU", "pool tokens",
                f"requests of {s.limit:,} at once", "pool sized", "how the engine stores it"):
        t.add_column(col, justify="right" if col[0] in "bKpr" and col != "pool sized" else "left")
    for p in pools:
        t.add_row(p.engine, p.kv_dtype, f"{p.bytes_per_token:,.0f}", fmt_gib(p.budget), f"{p.tokens:,}",
                  f"{p.sequences:,}", p.sized, escape(p.note))
    ui.console().print(t)
    for p in (p for p in pools if p.speculation):  # --speculative: each engine's drafter, and its pool without
        without = (f" (without the drafter: {p.tokens_without:,} tokens, {p.sequences_without:,} at once)"
                   if p.tokens_without is not None else "")
        typer.echo(f"  {p.engine}: {p.speculation}{without}")
    if lacking:
        typer.echo(f"Not in the table: {', '.join(lacking)} (no KV dtype {s.kv_dtype!r}).")
    sources = {p.overhead_source.split(";")[0] for p in pools}
    overhead = (f"every engine's {sources.pop()}" if len(sources) == 1 else
                "; ".join(f"{p.engine}'s {p.overhead_source.split(';')[0]}" for p in pools))
    typer.echo(f"KV budget: the usable memory less each engine's weights (as it serves them) and overhead "
               f"({overhead}). Measured pools: `kvbench report` of a run (its KV and boundary tables).")
