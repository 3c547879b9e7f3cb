import signal
from concurrent.futures import ThreadPoolExecutor

import typer
from rich.markup import escape

from kvbench.backends import DEFAULT_ENGINES, REGISTRY, gguf_converter
from kvbench.common import models, ui
from kvbench.common.envs import EnvInstallError, HomeError, allow_installs, ensure_env, stop_installs
from kvbench.common.suggest import with_hint
from kvbench.planner import model_names
from kvbench.run.backend_config import BackendConfig, ConfigError
from kvbench.run.home import home_refusal, recipes_needed


def setup(
    backend: list[str] = typer.Option(list(DEFAULT_ENGINES), "--backend", "-b", metavar="BACKEND",
                                      help="ENGINE[@VERSION][:KEY=VALUE,...]; repeat for several (kvbench backends lists them)."),
    model: str = typer.Option("smollm2", help="Also prepare this model's HF-format copy."),
):
    """Install each engine's isolated environment and prepare the model (idempotent: installs only what is missing)."""
    console = ui.console()
    try:
        configs = [BackendConfig.parse(b) for b in backend]
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    # SIGTERM ends setup as Ctrl-C does: the installer or converter running is stopped with it (its `finally`);
    # SIGINT too where it was ignored on entry (a shell's `&` job), as `kvbench run` heeds it
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        failed = _prepare(console, configs, model)
    except HomeError as exc:  # KVBENCH_HOME a file, read-only: found as it was written to
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):  # no second signal cuts the exit short (status -2)
            signal.signal(sig, signal.SIG_IGN)
        console.print("[yellow]setup interrupted: run it again to finish[/]")
        raise typer.Exit(130)
    if failed:
        raise typer.Exit(1)


def _sigterm_as_interrupt(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _prepare(console, configs: list[BackendConfig], model: str) -> bool:
    """Install every engine's environments and prepare the model; whether anything failed."""
    for cfg in configs:
        cls = REGISTRY[cfg.engine]
        if cls.attach_only:  # nothing of its own to install: no empty environment made
            console.print(f"{cfg.label}: nothing to install (it attaches to a running server)")
        elif own := cls.own_install(cfg.options):  # honoured before anything is installed
            console.print(f"{cfg.label}: nothing to install (it runs from {own})")
    recipes = recipes_needed(configs, every=True)
    try:
        path = models.locate(model)
    except models.ModelError:
        path = None  # said below, after the engines' installs
    if refusal := home_refusal(recipes, path):  # one line before any install, not a traceback during one
        raise HomeError(refusal)
    failed = _install_side_by_side(console, recipes)
    try:
        files = models.resolve(model, gguf_converter(console.print), log=console.print)
        console.print(f"[green]ready[/] model {files.name}: {files.hf_dir}" + (f", {files.gguf_path}" if files.gguf_path else ""))
    except models.ModelError as exc:
        failed = True
        console.print(f"[red]{escape(with_hint(str(exc), model, model_names()))}[/]")
    return failed


def _install_side_by_side(console, recipes: list) -> bool:
    """Install the recipes at once, reported in their order; whether any failed. Side by side because a
    fresh machine spends most of its set-up on llama.cpp's compile, which leaves the disk to the pip installs
    (docs/development.md has the times measured from nothing)."""
    failed = False
    allow_installs()
    with ThreadPoolExecutor(max_workers=max(1, len(recipes)), thread_name_prefix="install") as pool:
        futures = [pool.submit(ensure_env, recipe, console.print) for recipe in recipes]
        try:
            for recipe, future in zip(recipes, futures):
                try:
                    path = _result(future)
                    console.print(f"[green]ready[/] {recipe.name}: {path}")
                except EnvInstallError as exc:
                    failed = True
                    console.print(f"[red]{exc}[/]\n{exc.log_tail}")
        except BaseException:  # Ctrl-C or SIGTERM: the installers go with kvbench, not after it
            for future in futures:
                future.cancel()
            stop_installs()
            raise
    return failed


def _result(future):
    """The future's result, waited for in half seconds: a signal that reaches another thread than this one (as
    under a test runner's worker) is handled when this thread next runs, not when the install ends."""
    while True:
        try:
            return future.result(timeout=0.5)
        except TimeoutError:
            continue
