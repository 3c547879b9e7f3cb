"""The options of a run, each declared once (bench/run/option_fields.py): its flags of ``kvbench run`` with
their help and defaults, how their values are read and checked, and what run.json records of it.

Every check here runs before a run folder exists: a refusal is one line (exit 2) and creates nothing. The
options that take no flag are set in code (the tests', the self-checks').
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from kvbench.backends import DEFAULT_ENGINES, REGISTRY
from kvbench.common.files import PlainNameError, check_plain_name
from kvbench.common.redact import hold_userinfo, redact_text
from kvbench.run.backend_config import BackendConfig, ConfigError, check_attachable, distinct_labels, url_problem
from kvbench.run.option_fields import Flag, FlagError, option
from kvbench.run.prompt_salt import PromptSalt
from kvbench.workloads import MAX_REPEATS, Workload, available, check_cells
from kvbench.workloads import load as load_workload

if TYPE_CHECKING:  # the classes, imported where a value is made: a refused run imports neither pandas nor pyarrow
    from kvbench.run.telemetry import Prometheus
    from kvbench.store.writer import RunMode

DEFAULT_BACKENDS = list(DEFAULT_ENGINES)


def read_backends(flags: dict, earlier: dict) -> list[BackendConfig]:
    backend, url = flags["backend"], flags["url"]
    backends = [BackendConfig.parse(b) for b in backend]
    if url:
        if len(backends) != 1:
            raise ConfigError("--url attaches one backend: give exactly one --backend "
                              "(or a url=... option per backend)")
        backends = [BackendConfig.parse(f"{backend[0]}{',' if ':' in backend[0] else ':'}url={url}")]
    check_attachable(backends)
    return distinct_labels(backends)  # two settings of one engine: a label, cell ids and log each


def check_kv_dtypes(text: str | None, workload, backends) -> list[str] | None:
    """``--kv-dtypes`` as a list, refused (ValueError, one line) where the workload is not a kv_quant one or
    an engine of the run does not take a dtype named (or has no KV rules)."""
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


def seconds(flag: str):
    """A time that is a finite number of seconds above 0 (nan, inf, 0 and -5 parse as floats; the engine
    would then be blamed for timing out)."""
    def read(flags: dict, earlier: dict) -> float:
        (value,) = flags.values()
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} takes a number of seconds above 0, not {value}")
        return value
    return read


def read_load_workers(flags: dict, earlier: dict) -> int:
    """A load profile that cannot be split over load processes is refused before anything starts."""
    from kvbench.load.split import MAX_WORKERS

    if flags["load_workers"] > MAX_WORKERS:  # each one a process spawned on this machine
        raise ValueError(f"--load-workers {flags['load_workers']}: at most {MAX_WORKERS} load processes on one "
                         "machine")
    earlier["workload"].load.check_workers(flags["load_workers"])
    return flags["load_workers"]


def read_load_owner(flags: dict, earlier: dict) -> tuple[str, int] | None:
    """``--load-owner HOST:PORT`` as (host, port)."""
    text = flags["load_owner"]
    if text is None:
        return None
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise ValueError(f"--load-owner {text!r}: give HOST:PORT, e.g. kvbench-load-0.kvbench-load:7070")
    return host.strip("[]"), int(port)


def read_load_share(flags: dict, earlier: dict) -> tuple[int, int] | None:
    """``--load-share I/N`` as (I, N): one of N processes on as many machines, each sending its share of
    every cell of one experiment against servers they all attach to, started together at the owner's
    barrier (``--load-owner``). Refused where the shares could not be one experiment."""
    text = flags["load_share"]
    if text is None:
        if earlier["load_owner"] is not None:
            raise ValueError("--load-owner belongs to --load-share I/N: give both")
        return None
    from kvbench.load.split import MAX_SHARES, processes_used

    index, _, of = text.partition("/")
    if not (index.isascii() and of.isascii() and index.isdigit() and of.isdigit()):
        raise ValueError(f"--load-share {text[:40]!r}: give I/N with 0 <= I < N, e.g. 0/4 (I: this process's share)")
    if len(of) > 6 or int(of) > MAX_SHARES or len(index) > 6:  # the owner keeps a set of the N shares
        raise ValueError(f"--load-share {text[:40]}: at most {MAX_SHARES} shares (load processes) in one run")
    if not 0 <= int(index) < int(of):
        raise ValueError(f"--load-share {text!r}: give I/N with 0 <= I < N, e.g. 0/4 (I: this process's share)")
    index, of = int(index), int(of)
    if of > 1 and earlier["load_owner"] is None:
        raise ValueError(f"--load-share {text}: give --load-owner HOST:PORT too: the shares start every cell "
                         "together at the owner's barrier, on its clock (share 0 serves it)")
    if earlier["load_workers"] > 1:
        raise ValueError(f"--load-share {text} and --load-workers {earlier['load_workers']}: one load process per "
                         "share (run more shares instead)")
    started = [b.label for b in earlier["backends"] if not (b.url or b.urls)]
    if started:
        raise ValueError(f"--load-share {text}: every share must send to the same servers: attach to them (url=), "
                         f"not start {', '.join(started)} in each process")
    load = earlier["workload"].load
    if load.points_found_later():
        raise ValueError(f"--load-share {text}: load profile {load.name!r} finds its points by measuring, which "
                         "each share would do on its own: give its rates instead")
    for driver in load.drivers():
        if not driver.splits_over_workers:
            raise ValueError(f"--load-share {text}: load profile {driver.name!r} runs from one load process only")
    # a share that sends nothing in every cell still holds every barrier (and the owner waits for its pod)
    if of > 1 and (used := processes_used(load, of)) < of:
        raise ValueError(f"--load-share {text}: no cell of workload {earlier['workload'].name!r} splits over more "
                         f"than {used} load processes (its requests, closed-loop streams or open-loop cap): "
                         f"shares {used}..{of - 1} would send nothing; give N <= {used}")
    return index, of


def read_max_context(flags: dict, earlier: dict) -> int | None:
    value = flags["max_context"]
    if value is not None and value < 1:
        raise ValueError(f"--max-context takes a number of tokens of 1 or more, not {value}")
    return value


def read_repeats(flags: dict, earlier: dict) -> int | None:
    """--repeats within the workloads' bound, and the cells it makes with the workload's within theirs."""
    value = flags["repeats"]
    if value is not None:
        if value > MAX_REPEATS:
            raise ValueError(f"--repeats {value:,}: at most {MAX_REPEATS:,}")
        check_cells(earlier["workload"], value)
    return value


def read_run_id(flags: dict, earlier: dict) -> str | None:
    run_id = flags["run_id"]
    if run_id is not None:
        try:
            check_plain_name(run_id, "run id")  # a path would write outside --results-dir
        except PlainNameError as exc:
            raise FlagError(str(exc), "--run-id") from None
    return run_id


def read_results_mode(flags: dict, earlier: dict) -> RunMode:
    resume, overwrite = flags["resume"], flags["overwrite"]
    if resume and overwrite:
        raise FlagError("--resume and --overwrite exclude each other: give one", "--resume")
    if resume and earlier["run_id"] is None:
        raise FlagError("--resume needs --run-id: the run to finish", "--resume")
    return "resume" if resume else "overwrite" if overwrite else "new"


def read_prometheus(flags: dict, earlier: dict) -> Prometheus | None:
    url = flags["prometheus"]
    if url is None:
        return None
    if problem := url_problem(url):
        raise ConfigError(f"--prometheus {redact_text(url)!r} {problem}")
    from kvbench.run.telemetry import Prometheus
    parts = urlsplit(url)
    if parts.password is not None:  # masked from here on in whatever the Prometheus answers
        hold_userinfo(unquote(parts.username or ""), unquote(parts.password))
    return Prometheus(url, flags["prometheus_selector"], flags["prometheus_gpu_selector"])


def memory_wall_bytes(size: str) -> int:
    """--memory-limit in bytes, refused (ValueError, one line) where the size is not one or no wall can be
    made on this machine."""
    from kvbench.common.memory_wall import MemoryWallError, detect, parse_size

    limit = parse_size(size)
    try:
        detect()
    except MemoryWallError as exc:
        raise ValueError(f"--memory-limit: {exc}") from None
    return limit


def read_memory_limit(flags: dict, earlier: dict) -> int | None:
    if flags["memory_limit"] is None:
        return None
    limit = memory_wall_bytes(flags["memory_limit"])
    if any(b.url for b in earlier["backends"]):
        raise ConfigError("--memory-limit walls in the engines kvbench starts: an attached server (url=) "
                          "has its own memory")
    return limit


def read_prompt_salt(flags: dict, earlier: dict) -> str:
    PromptSalt.parse(flags["prompt_salt"], isolated=False)  # a bad salt is refused here, before any folder
    if earlier["load_share"] is not None and flags["prompt_salt"] in (None, "auto"):
        raise ValueError("--load-share: give every share the same --prompt-salt TEXT (or none): auto draws one per "
                         "process, and the shares would send different prompts")
    return flags["prompt_salt"]


def read_reset_cache(flags: dict, earlier: dict) -> bool:
    if flags["reset_cache_between_cells"]:
        cannot = sorted({b.engine for b in earlier["backends"] if not REGISTRY[b.engine].capabilities.prefix_cache.reset})
        if cannot:
            able = ", ".join(sorted(e for e in REGISTRY if REGISTRY[e].capabilities.prefix_cache.reset))
            raise ConfigError(f"--reset-cache-between-cells: {', '.join(cannot)} cannot empty a prefix cache "
                              f"(engines that can: {able})")
    return flags["reset_cache_between_cells"]


@dataclass(kw_only=True)
class RunOptions:
    """What one ``kvbench run`` does; the fields with flags in the order of its ``--help``."""

    backends: list[BackendConfig] = option(
        Flag("backend", list[str], DEFAULT_BACKENDS, "ENGINE[@VERSION][:KEY=VALUE,...]; repeat for several. "
             f"Engines: {', '.join(sorted(REGISTRY))}.", names=("--backend", "-b"), metavar="BACKEND"),
        Flag("url", str, None, "Benchmark a server already running at this URL instead of starting one "
             "(one --backend; or give each backend its own url=... option)."),
        read=read_backends, record="backends",
        recorded=lambda backends, run: [b.model_dump() | {"label": b.label} for b in backends])
    model: str = option(Flag("model", str, "smollm2", "'smollm2' (embedded), a .gguf file or an HF model folder."),
                        default="smollm2")
    workload: Workload = option(
        Flag("workload", str, "long_context_ladder", f"A workload name ({', '.join(available())}) or a .toml path."),
        read=lambda flags, earlier: load_workload(flags["workload"]), record="workload",
        recorded=lambda workload, run: workload.model_dump())
    kv_dtype: str = option(Flag("kv_dtype", str, "auto", "KV cache dtype: auto (the model's), or e.g. fp32, bf16, "
                                "q8_0."), record="kv_dtype")
    # a kv_quant workload's KV dtypes (None: the workload's), one engine start each
    kv_dtypes: list[str] | None = option(
        Flag("kv_dtypes", str, None, "A kv_quant workload's KV dtypes, one engine start each, e.g. q8_0,q4_0: "
             "dtype names, 'baseline' (the engine's own 16-bit cache, always run first) and 'quantised' (every "
             "dtype below 16 bits it takes); default: the workload's (docs/kv-quant.md).", metavar="LIST"),
        read=lambda flags, earlier: check_kv_dtypes(flags["kv_dtypes"], earlier["workload"], earlier["backends"]),
        default=None)
    # recorded as asked (run.json's model.max_context is the limit the run used): a resume must ask the same
    max_context: int | None = option(Flag("max_context", int, None, "Cap the context below the model's own limit."),
                                     read=read_max_context, default=None, record="max_context_asked")
    results_dir: Path = option(Flag("results_dir", Path, Path("results/runs"), "Where the run's folder is created."))
    run_id: str | None = option(
        Flag("run_id", str, None, "Name of the run folder (default: time, workload, host, pid): letters, digits, "
             "'.', '_', '-'. An existing run is refused unless --resume or --overwrite is given."),
        read=read_run_id, default=None, record="run_id", recorded=lambda run_id, run: run.run_id)
    # an existing run folder: refused ("new"), finished ("resume") or replaced ("overwrite")
    results_mode: RunMode = option(
        Flag("resume", bool, False, "Finish the run --run-id: run only the cells it has no row for, keep what is "
             "there, record both invocations.", names=("--resume",)),
        Flag("overwrite", bool, False, "Replace the run --run-id (its folder is emptied first).",
             names=("--overwrite",)),
        read=read_results_mode, default="new")
    repeats: int | None = option(
        Flag("repeats", int, None, "Run every cell this many times (default: the workload's); repeats give "
             "confidence intervals to kvbench compare.", min=1),
        read=read_repeats, default=None, record="repeats",
        recorded=lambda repeats, run: repeats or run.o.workload.repeats)
    # each repeat runs on every backend in turn (one engine at a time, restarted per repeat), the order
    # reversed on odd repeats (AB BA AB ...); compare then pairs the repeats by index
    interleave: bool = option(
        Flag("interleave", bool, False, "A/B on a noisy machine: run each repeat on every backend in turn (AB BA "
             "AB ..., one engine at a time) so that machine drift hits every side alike; kvbench compare then "
             "pairs the repeats.", names=("--interleave",)),
        record="interleaved")
    start_timeout_s: float = option(Flag("start_timeout", float, 600.0, "Seconds an engine may take to become ready."),
                                    read=seconds("--start-timeout"), default=600.0)
    request_timeout_s: float = option(Flag("request_timeout", float, 900.0, "Seconds one request may take."),
                                      read=seconds("--request-timeout"), default=900.0)
    load_workers: int = option(
        Flag("load_workers", int, 1, "Load generator processes, each with its own event loop (requests split over "
             "them): for rates one core cannot send.", min=1),  # bench/load/workers.py
        read=read_load_workers, default=1)
    # several machines: this process's share of every cell and the owner of the run's clock and start barrier
    # (bench/load/owner.py); kvbench merge joins the shares' run folders
    load_owner: tuple[str, int] | None = option(
        Flag("load_owner", str, None, "With --load-share: HOST:PORT of share 0's process, the run's owner, whose "
             "clock every share's records are put on and whose barrier starts each cell in every share at once; "
             "share 0 serves it there (binding HOST: 0.0.0.0 for pods).", metavar="HOST:PORT"),
        read=read_load_owner, default=None, record="load_owner",
        recorded=lambda owner, run: None if owner is None else f"{owner[0]}:{owner[1]}")
    load_share: tuple[int, int] | None = option(
        Flag("load_share", str, None, "I/N: send share I (from 0) of every cell, one of N kvbench runs (pods) "
             "attached to the same servers with the same workload, model and --prompt-salt; kvbench merge "
             "joins their run folders into one run (docs/deployments.md).", metavar="I/N"),
        read=read_load_share, default=None, record="load_share",
        recorded=lambda share, run: None if share is None else {"index": share[0], "of": share[1]})
    # read after each cell: GPU memory (DCGM) and engine metrics
    prometheus: Prometheus | None = option(
        Flag("prometheus", str, None, "Read each cell's GPU memory (DCGM exporter) and the engines' metrics from "
             "this Prometheus (its HTTP API URL), e.g. for servers kvbench did not start (docs/telemetry.md)."),
        Flag("prometheus_selector", str, "", "Label matchers for those queries, e.g. '{namespace=\"llm\"}'."),
        Flag("prometheus_gpu_selector", str, None, "Label matchers for the DCGM (GPU) series instead, e.g. "
             "'{Hostname=\"gpu-node-1\"}' (default: --prometheus-selector)."),
        read=read_prometheus, default=None)
    memory_limit_bytes: int | None = option(
        Flag("memory_limit", str, None, "Run each engine's whole process tree inside a memory wall of SIZE (e.g. "
             "1.5GiB, 800MiB: a memory cgroup, the CPU stand-in for a GPU's memory): an engine that grows past it "
             "is killed and its cells fail 'out of memory at the SIZE wall'. Needs root and a memory cgroup.",
             metavar="SIZE"),
        read=read_memory_limit, default=None, record="memory_limit_bytes")
    # None/"auto" draws one, "none" sends unsalted prompts (an earlier run's, token for token), else the salt
    prompt_salt: str | None = option(
        Flag("prompt_salt", str, "auto", "What keeps this run's prompts from sharing a prefix with any other run's "
             "(a server kvbench attaches to has cached the last run's): auto draws one per run (the same on every "
             "engine of the run), none sends the unsalted prompts of earlier runs token for token, TEXT pins one. "
             "Engines with a cache-isolation field (vLLM's cache_salt) get it there when every engine of the run "
             "has one (docs/workloads.md).", metavar="SALT"),
        read=read_prompt_salt, default=None, record="prompt_salt", recorded=lambda salt, run: run.salt.to_dict())
    reset_cache_between_cells: bool = option(
        Flag("reset_cache_between_cells", bool, False, "Empty each engine's prefix cache before every cell "
             "(engines that can: kvbench backends).", names=("--reset-cache-between-cells",)),
        read=read_reset_cache, default=False, record="reset_cache_between_cells")
    allow_model_mismatch: bool = option(
        Flag("allow_model_mismatch", bool, False, "Run an attached server that serves another model than --model "
             "(its /v1/models), with a warning, instead of failing its cells.", names=("--allow-model-mismatch",)))
    # step "report" after the last cell: the folder holds everything it is made of
    report: bool = option(
        Flag("no_report", bool, False, "Write the results folder only, no report at the end (kvbench report RUN "
             "makes it from the folder later): e.g. a pipeline that reports several runs together.",
             names=("--no-report",)),
        read=lambda flags, earlier: not flags["no_report"], default=True)
    # set in code only
    command: list[str] = option(record="command", recorded=lambda command, run: redact_text(" ".join(command)),
                                default_factory=lambda: list(sys.argv))
    memory_hz: float = 20.0
    kv_poll_hz: float = 10.0
    max_consecutive_timeouts: int | None = 3  # an engine whose requests time out this often in a row is wedged
    estimate: bool = True  # one calibration request per engine start, to say how long its cells will take

    @property
    def needs_weights(self) -> bool:
        """Whether kvbench starts an engine, which loads the model's weights: a hub id is then downloaded
        whole; a run whose every engine is attached reads only the config, index and tokenizer."""
        return any(cfg.url is None for cfg in self.backends)
