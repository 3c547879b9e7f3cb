import json
from pathlib import Path

import typer
from rich.markdown import Markdown

from kvbench import models, ui
from kvbench.backends import REGISTRY, gguf_converter
from kvbench.config import BackendConfig, ConfigError
from kvbench.envs import EnvInstallError, ensure_env
from kvbench.validate import markdown, run_all

VALIDATION_FILE = "kv_validation.jsonl"


def validate(
    backend: list[str] = typer.Option(["hf", "vllm", "llamacpp"], "--backend", "-b", help="Engines to check."),
    into: Path = typer.Option(None, help="A run folder to add the table to (default: results/validation/)."),
):
    """Check the KV model against what the real engines allocate (predicted, engine-reported, measured)."""
    console = ui.console()
    try:
        configs = [BackendConfig.parse(b) for b in backend]
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    model = models.resolve("smollm2", gguf_converter(console.print), log=console.print)
    envs = {}
    for cfg in configs:
        try:
            envs[cfg.engine] = ensure_env(REGISTRY[cfg.engine].recipe(cfg.version), log=console.print)
        except EnvInstallError as exc:
            console.print(f"[red]{exc}[/]\n{exc.log_tail}")
    out_dir = into or Path("results/validation")
    rows = run_all(envs, model, out_dir / "logs" / "validation", log=console.print)
    with (out_dir / VALIDATION_FILE).open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    console.print(Markdown(markdown(rows)))
    console.print(f"written to {out_dir / VALIDATION_FILE}")
    if not all(r["ok"] for r in rows):
        raise typer.Exit(1)
