import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import typer
from rich.markdown import Markdown

from kvbench.backends import DEFAULT_ENGINES, REGISTRY, gguf_converter
from kvbench.backends.types import EngineStartError
from kvbench.common import models, ui
from kvbench.common.envs import EnvInstallError, ensure_env
from kvbench.common.files import OutputRefused, atomic_write_text, check_output_folder, kvbench_jsonl
from kvbench.common.hardware import environment_info
from kvbench.run.backend_config import BackendConfig, ConfigError
from kvbench.run.validate import (families, family_markdown, markdown, measure_families, run_all, speculative_checks,
                                   speculative_engines)

VALIDATION_FILE = "kv_validation.jsonl"
FAMILIES_FILE = "kv_families.jsonl"
FAMILIES_TABLE = "kv_families.md"
FAMILIES_TITLE = "# KV rules against the engines, by attention family"
SPECULATIVE_FILE = "kv_speculative.jsonl"


def validate(
    backend: list[str] = typer.Option(list(DEFAULT_ENGINES), "--backend", "-b", metavar="BACKEND",
                                      help="Engines to check: ENGINE[@VERSION]; repeat for several."),
    into: Path = typer.Option(None, help="A run folder to add the tables to (default: results/validation/)."),
    with_families: bool = typer.Option(False, "--families", help="Also measure the validation families (GQA, MQA, "
                                       "MHA, windows, sinks, chunks, MLA, MoE) in every engine (minutes per engine)."),
    only: list[str] = typer.Option([], "--family", help="Only these families (repeat); implies --families."),
    embedded: bool = typer.Option(True, "--embedded/--no-embedded", help="The engines' own cases on the embedded model."),
    speculative: bool = typer.Option(False, "--speculative", help="Also check a drafter's KV (the embedded model "
                                     "drafting for itself) in every engine that has a draft model: vLLM's pool with "
                                     "and without it, llama.cpp's draft context's KV buffer."),
):
    """Check the engines' KV rules against what the real engines allocate (predicted, engine-reported, measured)."""
    console = ui.console()
    try:
        configs = [BackendConfig.parse(b) for b in backend]
        chosen = families(only or None) if (with_families or only) else []
    except (ConfigError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    for cfg in configs:  # before anything is installed: an empty table would read as a pass
        if refusal := REGISTRY[cfg.engine].validation_refusal():
            typer.echo(f"error: kvbench validate: {cfg.engine} {refusal}", err=True)
            raise typer.Exit(2)
    out_dir = into or Path("results/validation")
    try:  # only new files or kvbench's own: never through a link, onto a device or over another's file
        check_output_folder(out_dir, "--into folder",
                            {VALIDATION_FILE: kvbench_jsonl, FAMILIES_FILE: kvbench_jsonl, SPECULATIVE_FILE: kvbench_jsonl,
                             FAMILIES_TABLE: lambda head: head.startswith(FAMILIES_TITLE.encode())})
    except OutputRefused as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    model = models.resolve("smollm2", gguf_converter(console.print), log=console.print)
    envs = {}
    for cfg in configs:
        try:
            envs[cfg.engine] = ensure_env(REGISTRY[cfg.engine].recipe(cfg.version), log=console.print)
        except EnvInstallError as exc:
            console.print(f"[red]{exc}[/]\n{exc.log_tail}")
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = True
    if embedded:
        rows = run_all(envs, model, out_dir / "logs" / "validation", log=console.print)
        _write_jsonl(out_dir / VALIDATION_FILE, rows)
        console.print(Markdown(markdown(rows)))
        console.print(f"written to {out_dir / VALIDATION_FILE}")
        ok = all(r["ok"] for r in rows)
    if chosen:
        rows = measure_families(envs, chosen, model.hf_dir, out_dir / "logs" / "families", log=console.print)
        _write_jsonl(out_dir / FAMILIES_FILE, rows)
        table = family_markdown(rows)
        env = environment_info()
        header = [FAMILIES_TITLE, "",
                  f"Command: `{shlex.join(['kvbench', *sys.argv[1:]])}` ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
                  f"Machine: {env['cpu']}, {env['cpu_count']} cores ({', '.join(env['cpu_flags']) or 'no AVX flags read'}), "
                  f"GPU: {', '.join(g['name'] for g in env['gpus']) or 'none'}; engines: "
                  + ", ".join(f"{c.engine} {c.version}" for c in configs), "",
                  "Plain formula: the config's KV at face value (every caching layer, windows applied). Engine's "
                  "rules: kvbench's prediction under that engine's rules (its adapter's kv_rules). Engine's own: "
                  "what the engine allocated, measured here (equal: to the byte, or to the 0.01 MiB its log prints).",
                  ""]
        atomic_write_text(out_dir / FAMILIES_TABLE, "\n".join(header) + "\n" + table + "\n")
        console.print(Markdown(table))
        console.print(f"written to {out_dir / FAMILIES_TABLE} and {out_dir / FAMILIES_FILE}")
        # a family an engine cannot load here is reported, not failed; a measured difference fails
        ok = ok and not any(r["predicted"] is not None and not r["ok"] and
                            (r["measured"] is not None or r["engine_reported"] is not None) for r in rows)
    if speculative:
        rows = []
        for engine in speculative_engines(list(envs)):
            console.print(f"checking a drafter's KV against {engine}")
            try:
                rows += [c.row() for c in speculative_checks(engine, envs[engine], model,
                                                             out_dir / "logs" / "speculative")]
            except (EngineStartError, RuntimeError, OSError) as exc:
                rows.append({"engine": engine, "case": "draft", "quantity": "-", "predicted": None,
                             "engine_reported": None, "measured": None, "tolerance": 0, "note": f"failed: {exc}",
                             "error_pct": None, "ok": False})
        _write_jsonl(out_dir / SPECULATIVE_FILE, rows)
        console.print(Markdown(markdown(rows)))
        console.print(f"written to {out_dir / SPECULATIVE_FILE}")
        ok = ok and all(r["ok"] for r in rows)
    if not ok:
        raise typer.Exit(1)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))  # written whole or not at all
