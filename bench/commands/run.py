import math
import signal
from pathlib import Path

import typer
from rich.markup import escape

from kvbench import reports
from kvbench.backends import DEFAULT_ENGINES, REGISTRY
from kvbench.common import ui
from kvbench.common.files import PlainNameError, check_plain_name
from kvbench.common.models import ModelError, locate, max_context_known
from kvbench.common.redact import redact_text
from kvbench.common.suggest import with_hint
from kvbench.planner import model_names
from kvbench.run.backend_config import BackendConfig, ConfigError, check_attachable, distinct_labels, url_problem
from kvbench.run.cells import NothingFits, PromptSalt, RunPlan
from kvbench.run.runner import Runner, RunOptions
from kvbench.run.telemetry import Prometheus
from kvbench.store.errors import ResultsReadError, ResultsWriteError, RunFolderError
from kvbench.store.readers import load_cells
from kvbench.workloads import WorkloadError, available
from kvbench.workloads import load as load_workload

DEFAULT_BACKENDS = list(DEFAULT_ENGINES)


def run(
    backend: list[str] = typer.Option(DEFAULT_BACKENDS, "--backend", "-b", metavar="BACKEND",
                                      help="ENGINE[@VERSION][:KEY=VALUE,...]; repeat for several. "
                                           f"Engines: {', '.join(sorted(REGISTRY))}."),
    model: str = typer.Option("smollm2", help="'smollm2' (embedded), a .gguf file or an HF model folder."),
    workload: str = typer.Option("long_context_ladder", help=f"A workload name ({', '.join(available())}) or a .toml path."),
    kv_dtype: str = typer.Option("auto", help="KV cache dtype: auto (the model's), or e.g. fp32, bf16, q8_0."),
    kv_dtypes: str = typer.Option(None, metavar="LIST",
                                  help="A kv_quant workload's KV dtypes, one engine start each, e.g. q8_0,q4_0: "
                                       "dtype names, 'baseline' (the engine's own 16-bit cache, always run "
                                       "first) and 'quantised' (every dtype below 16 bits it takes); default: "
                                       "the workload's (docs/kv-quant.md)."),
    max_context: int = typer.Option(None, help="Cap the context below the model's own limit."),
    results_dir: Path = typer.Option(Path("results/runs"), help="Where the run's folder is created."),
    run_id: str = typer.Option(None, help="Name of the run folder (default: time, workload, host, pid): letters, "
                                          "digits, '.', '_', '-'. An existing run is refused unless --resume "
                                          "or --overwrite is given."),
    resume: bool = typer.Option(False, "--resume", help="Finish the run --run-id: run only the cells it has no row "
                                                         "for, keep what is there, record both invocations."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run --run-id (its folder is emptied first)."),
    repeats: int = typer.Option(None, min=1, help="Run every cell this many times (default: the workload's); "
                                                 "repeats give confidence intervals to kvbench compare."),
    interleave: bool = typer.Option(False, "--interleave",
                                    help="A/B on a noisy machine: run each repeat on every backend in turn (AB BA "
                                         "AB ..., one engine at a time) so that machine drift hits every side "
                                         "alike; kvbench compare then pairs the repeats."),
    url: str = typer.Option(None, help="Benchmark a server already running at this URL instead of starting one "
                                       "(one --backend; or give each backend its own url=... option)."),
    start_timeout: float = typer.Option(600.0, help="Seconds an engine may take to become ready."),
    request_timeout: float = typer.Option(900.0, help="Seconds one request may take."),
    load_workers: int = typer.Option(1, min=1, help="Load generator processes, each with its own event loop "
                                                    "(requests split over them): for rates one core cannot send."),
    prometheus: str = typer.Option(None, help="Read each cell's GPU memory (DCGM exporter) and the engines' "
                                              "metrics from this Prometheus (its HTTP API URL), e.g. for "
                                              "servers kvbench did not start (docs/telemetry.md)."),
    prometheus_selector: str = typer.Option("", help="Label matchers for those queries, e.g. "
                                                     "'{namespace=\"llm\"}'."),
    prometheus_gpu_selector: str = typer.Option(None, help="Label matchers for the DCGM (GPU) series instead, "
                                                           "e.g. '{Hostname=\"gpu-node-1\"}' (default: "
                                                           "--prometheus-selector)."),
    memory_limit: str = typer.Option(None, metavar="SIZE",
                                     help="Run each engine's whole process tree inside a memory wall of SIZE "
                                          "(e.g. 1.5GiB, 800MiB: a memory cgroup, the CPU stand-in for a GPU's "
                                          "memory): an engine that grows past it is killed and its cells fail "
                                          "'out of memory at the SIZE wall'. Needs root and a memory cgroup."),
    prompt_salt: str = typer.Option("auto", metavar="SALT",
                                    help="What keeps this run's prompts from sharing a prefix with any other run's "
                                         "(a server kvbench attaches to has cached the last run's): auto draws "
                                         "one per run (the same on every engine of the run), none sends the "
                                         "unsalted prompts of earlier runs token for token, TEXT pins one. "
                                         "Engines with a cache-isolation field (vLLM's cache_salt) get it there "
                                         "when every engine of the run has one (docs/workloads.md)."),
    reset_cache_between_cells: bool = typer.Option(False, "--reset-cache-between-cells",
                                                   help="Empty each engine's prefix cache before every cell "
                                                        "(engines that can: kvbench backends)."),
    allow_model_mismatch: bool = typer.Option(
        False, "--allow-model-mismatch", help="Run an attached server that serves another model than --model "
                                               "(its /v1/models), with a warning, instead of failing its cells."),
):
    """Run a workload on each backend and write the results folder, then print the report."""
    console = ui.console()
    if resume and overwrite:
        raise typer.BadParameter("--resume and --overwrite exclude each other: give one", param_hint="--resume")
    if resume and run_id is None:
        raise typer.BadParameter("--resume needs --run-id: the run to finish", param_hint="--resume")
    if run_id is not None:
        try:
            check_plain_name(run_id, "run id")  # a path would write outside --results-dir
        except PlainNameError as exc:
            raise typer.BadParameter(str(exc), param_hint="--run-id") from None
    results_mode = "resume" if resume else "overwrite" if overwrite else "new"
    try:
        check_numbers(start_timeout=start_timeout, request_timeout=request_timeout, max_context=max_context)
        backends = [BackendConfig.parse(b) for b in backend]
        if url:
            if len(backends) != 1:
                raise ConfigError("--url attaches one backend: give exactly one --backend "
                                  "(or a url=... option per backend)")
            backends = [BackendConfig.parse(f"{backend[0]}{',' if ':' in backend[0] else ':'}url={url}")]
        check_attachable(backends)
        backends = distinct_labels(backends)  # two settings of one engine: a label, cell ids and log each
        wl = load_workload(workload)
        wl.load.check_workers(load_workers)  # a profile that cannot be split is refused before anything starts
        if prometheus is not None and (problem := url_problem(prometheus)):
            raise ConfigError(f"--prometheus {redact_text(prometheus)!r} {problem}")
        prom = Prometheus(prometheus, prometheus_selector, prometheus_gpu_selector) if prometheus else None
        memory_limit_bytes = memory_wall_bytes(memory_limit) if memory_limit is not None else None
        if memory_limit_bytes is not None and any(b.url for b in backends):
            raise ConfigError("--memory-limit walls in the engines kvbench starts: an attached server (url=) "
                              "has its own memory")
        PromptSalt.parse(prompt_salt, isolated=False)  # a bad salt is refused here, before any folder
        kv_list = check_kv_dtypes(kv_dtypes, wl, backends)
        if reset_cache_between_cells:
            cannot = sorted({b.engine for b in backends if not REGISTRY[b.engine].capabilities.prefix_cache.reset})
            if cannot:
                able = ", ".join(sorted(e for e in REGISTRY if REGISTRY[e].capabilities.prefix_cache.reset))
                raise ConfigError(f"--reset-cache-between-cells: {', '.join(cannot)} cannot empty a prefix cache "
                                  f"(engines that can: {able})")
    except (ConfigError, WorkloadError, ValueError) as exc:  # one line, exit 2, nothing installed or created
        text = with_hint(str(exc), workload, available()) if isinstance(exc, WorkloadError) else str(exc)
        typer.echo(f"error: {text}", err=True)
        raise typer.Exit(2)
    try:
        path = locate(model)  # a model that is not there is refused before a run folder exists
    except ModelError as exc:
        typer.echo(f"error: {with_hint(str(exc), model, model_names())}", err=True)
        raise typer.Exit(2)
    try:
        # what the runner would refuse after creating the folder, refused before it where it costs nothing
        limit = max_context_known(path) or max_context  # a GGUF's limit is known once its HF copy is read
        if limit:
            RunPlan.make(wl, limit, max_context, repeats)
    except NothingFits as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    options = RunOptions(model=model, workload=wl, backends=backends, results_dir=results_dir, run_id=run_id,
                         kv_dtype=kv_dtype, max_context=max_context, start_timeout_s=start_timeout,
                         request_timeout_s=request_timeout, repeats=repeats, results_mode=results_mode,
                         interleave=interleave, load_workers=load_workers, prometheus=prom,
                         memory_limit_bytes=memory_limit_bytes, prompt_salt=prompt_salt,
                         reset_cache_between_cells=reset_cache_between_cells, allow_model_mismatch=allow_model_mismatch,
                         kv_dtypes=kv_list)
    # errors print with soft_wrap: one line even past the console width (greppable in CI logs)
    try:
        runner = Runner(options, console)
    except (RunFolderError, ResultsReadError) as exc:  # an existing run, or a damaged one to resume
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2)
    except ResultsWriteError as exc:  # --results-dir read-only, not permitted, full
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1)
    try:
        run_dir = runner.run()
    except ModelError as exc:
        console.print(f"[red]error:[/] {with_hint(str(exc), model, model_names())}")
        raise typer.Exit(2)
    except ResultsWriteError as exc:  # the runner stopped: say the first write error, once
        console.print(f"[red]error:[/] {escape(str(runner.writer.failed or exc))}", soft_wrap=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        # ignored from here on: at exit Python puts its own handlers back to the default, and a second Ctrl-C
        # then would end the process by the signal (status -2) instead of exit 130
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        console.print(f"[yellow]interrupted; finished cells are in {runner.run_dir}[/]")
        raise typer.Exit(130)
    try:
        md, page, _, built = reports.write_report([run_dir])
        from kvbench.reports import terminal

        terminal.render(built, console)  # the report, as `kvbench report` prints it (and as --help promises)
    except ResultsWriteError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}; the results are in {escape(str(run_dir))}", soft_wrap=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:  # the run is whole; each report file is replaced atomically or not at all
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        console.print(f"[yellow]interrupted while writing the report; the run is finished in {run_dir} "
                      f"(kvbench report {run_dir})[/]")
        raise typer.Exit(130)
    console.print(f"\nresults: {run_dir}\nreport:  {md} and {page}  (kvbench report {run_dir})")
    cells = load_cells(run_dir)
    if cells.empty or (cells.status == "failed").all():
        raise typer.Exit(1)


def check_numbers(start_timeout: float, request_timeout: float, max_context: int | None) -> None:
    """ValueError (one line) for a time that is not a finite number of seconds above 0 (nan, inf, 0 and -5
    parse as floats; the engine would then be blamed for timing out), or a --max-context below 1."""
    for option, seconds in (("--start-timeout", start_timeout), ("--request-timeout", request_timeout)):
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{option} takes a number of seconds above 0, not {seconds}")
    if max_context is not None and max_context < 1:
        raise ValueError(f"--max-context takes a number of tokens of 1 or more, not {max_context}")


def check_kv_dtypes(text: str | None, workload, backends) -> list[str] | None:
    """``--kv-dtypes`` as a list, refused (ValueError, one line) before any run folder exists where the workload
    is not a kv_quant one or an engine of the run does not take a dtype named (or has no KV rules)."""
    from kvbench.backends import kv_rules
    from kvbench.kv.rules import KVQuestion, KVRuleError

    if text is not None and workload.family != "kv_quant":
        raise ValueError(f"--kv-dtypes: workload {workload.name} is not a kv_quant workload (family "
                         f"{workload.family!r}); the KV-quantisation workload is kv_quant")
    names = [n.strip() for n in text.split(",") if n.strip()] if text is not None else None
    if text is not None and not names:
        raise ValueError("--kv-dtypes: give one or more dtype names, e.g. q8_0,q4_0")
    if workload.family != "kv_quant":
        return None
    for b in backends:
        rules = kv_rules(b.engine)
        if rules is None:
            raise ValueError(f"{b.engine} has no KV rules (no KV dtypes to sweep): a kv_quant run needs them")
        for name in names or [n for n in workload.kv_dtypes if n not in ("baseline", "quantised")]:
            if name.lower() == "auto":  # every engine takes it; what it means needs the model, read later
                continue
            try:
                rules.resolve_dtype(KVQuestion(None, name))
            except KVRuleError as exc:
                raise ValueError(f"--kv-dtypes: {exc}") from None
    return names


def memory_wall_bytes(size: str) -> int:
    """--memory-limit in bytes, refused (ValueError, one line) before any run folder exists where the size is
    not one or no wall can be made on this machine."""
    from kvbench.common.memory_wall import MemoryWallError, detect, parse_size

    limit = parse_size(size)
    try:
        detect()
    except MemoryWallError as exc:
        raise ValueError(f"--memory-limit: {exc}") from None
    return limit
