"""The articles' optimisation table, measured: ``python -m kvbench.selfcheck.optimisation_table --out DIR``.

For a model and a memory budget, the columns of kvbench.selfcheck.optimisation.columns in the articles' order
(static batching with a contiguous cache, + paged KV, + 8-bit KV, + 4-bit KV, + continuous batching, + prefix
sharing, + speculation), each a real engine configuration started inside a memory wall (a memory cgroup, the
CPU stand-in for a GPU's memory: ``kvbench run --memory-limit``).

The budget is the memory for requests above each engine's idle footprint: each engine is first started once
for one request in a wall far above its needs (its calibration trial), and the most it held and used at once
from its start on (anonymous and shared memory, and the files it maps: :meth:`MemoryWall.resident_bytes`,
sampled at 20 Hz: vLLM's start peaks above what it holds once serving) less its KV pool is its idle
footprint; its wall is that plus the budget. (An engine's idle footprint differs by 2 GiB between llama.cpp
and vLLM's CPU runtime; one wall for all would measure that, not the optimisations.) ``--memory SIZE`` gives
every engine the same wall instead.

A capacity column climbs a ladder of batches from the planner's answer at that wall: each rung one start with
room for B requests of N tokens, B requests sent together, then one request as long as the batch's tokens (or
the slot's limit where each slot reserves one); up while the batch runs, down while it does not, until a rung
that ran and one that did not are a step apart. Every trial is a line of trials.jsonl, its requests in
requests/; the table (table.md) is computed from those files alone (``--table-from DIR`` redoes it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

from kvbench.common.files import atomic_write_text
from kvbench.common.memory_wall import format_bytes, parse_size
from kvbench.selfcheck.optimisation import table as tables
from kvbench.selfcheck.optimisation.columns import Column, Config, Scale, registered

MIB = 2**20
CALIBRATION_WALL = 8 * 2**30  # far above any engine's needs for one request: the wall only reads its counters
MAX_RUNGS = 4


def ceil_mib(n: float) -> int:
    return int(math.ceil(n / MIB)) * MIB


def config_record(c: Config) -> dict:
    return {"key": c.key, "engine": c.engine, "label": c.label, "kv_dtype": c.kv_dtype, "options": c.all_options,
            "plan_options": c.all_plan_options, "pool": c.pool, "reserve": c.reserve, "prefix_tokens": c.prefix_tokens,
            "prefix_caching": c.prefix_caching}


def build_columns(scale: Scale, chosen: list[str], settings: dict[str, dict]) -> list[tuple[Column, list[Config]]]:
    """The columns asked for, each with its settings and configurations (the columns before it built first,
    chosen or not: the optimisations stack)."""
    before: dict[str, list[Config]] = {}
    out = []
    for key, cls in registered().items():
        column = cls(**settings.get(key, {}))
        before[key] = column.configs(scale, before)
        if key in chosen:
            out.append((column, before[key]))
    return out


def describe(scale: Scale, columns: list[tuple[Column, list[Config]]]) -> list[dict]:
    """run.json's ``columns``: what each column is and the configurations it ran."""
    out = []
    before: dict[str, list[Config]] = {}
    for column, configs in columns:
        before[column.key] = configs
        out.append({"key": column.key, "title": column.title, "adds": column.adds, "kind": column.kind,
                    "settings": column.model_dump(), "configs": [config_record(c) for c in configs],
                    "baselines": {c.key: config_record(b) for c in configs if (b := column.baseline(c))},
                    "skipped": column.skipped(scale, before)})
    return out


class Run:
    """The engines' trials of one table, written as they come."""

    def __init__(self, scale: Scale, model, out: Path, log_dir: Path, say, memory: int | None):
        from kvbench.selfcheck.optimisation.trials import Prompts

        self.scale, self.model, self.out, self.log_dir, self.say = scale, model, out, log_dir, say
        self.memory = memory
        self.prompts = Prompts(model)
        self.records: list[dict] = []
        self.walls: dict[str, dict] = {}
        self.survivors: list[dict] = []
        (out / "requests").mkdir(parents=True, exist_ok=True)

    def trial(self, trial_id: str, column: str, config: Config, purpose: str, batch: int, spec, phases,
              main_phase: str, **extra) -> dict:
        from kvbench.selfcheck.optimisation.trials import run_trial, setting, verdict

        facts, requests, survivors = run_trial(config, spec, phases, self.log_dir / f"{trial_id}.log")
        self.survivors += survivors
        main = next((p for p in facts["phases"] if p["name"] == main_phase), {})
        sent = next(len(p.prompts) for p in phases if p.name == main_phase)
        record = {"trial": trial_id, "column": column, "config": config.key, "engine": config.engine,
                  "kv_dtype": config.kv_dtype, "purpose": purpose, "rung": batch, "setting": setting(spec, config),
                  "wall_bytes": spec.memory_limit_bytes, "verdict": verdict(facts, main_phase, sent, purpose == "rung"),
                  "requests_sent": sent, "requests_ok": main.get("ok", 0), "running_peak": main.get("running_peak"),
                  "waiting_peak": main.get("waiting_peak"), "batch_size": main.get("batch_size"),
                  "metrics": main.get("metrics") or {}, **{k: v for k, v in facts.items() if k != "phases"},
                  "phases": [{k: v for k, v in p.items() if k != "metrics"} for p in facts["phases"]],
                  "requests_file": f"requests/{trial_id}.jsonl", **extra}
        # it ran with its usage held at the wall: the kernel took back file pages (libraries, files read) to keep
        # it under, rather than kill it
        record["at_the_wall"] = bool(record["verdict"] == "ran" and record["peak_bytes"] is not None
                                     and record["peak_bytes"] >= spec.memory_limit_bytes - MIB)
        longest = next((p for p in facts["phases"] if p["name"] == "longest"), None)
        if any(p.name == "longest" for p in phases) and record["verdict"] == "ran":
            record["longest_verdict"] = ("ran" if longest and longest["ok"] == longest["requests"] else
                                         "killed" if facts.get("oom_kills") else "failed")
        atomic_write_text(self.out / record["requests_file"], "".join(json.dumps(r) + "\n" for r in requests))
        self.records.append(record)
        self.save()
        peak = format_bytes(record["peak_bytes"]) if record["peak_bytes"] is not None else "-"
        self.say(f"{trial_id}: {record['verdict']}, peak {peak} of {format_bytes(spec.memory_limit_bytes)}, "
                 f"{record['requests_ok']}/{sent} requests, {record['seconds']:.0f} s"
                 + (f" ({record['exit']})" if record["exit"] else ""))
        return record

    def save(self) -> None:
        atomic_write_text(self.out / "trials.jsonl", "".join(json.dumps(r) + "\n" for r in self.records))

    # --- the wall per engine -------------------------------------------------------------------------
    def calibrate(self, config: Config) -> dict:
        """The engine's idle footprint, measured in a wall far above its needs: the most it held and used at once
        from its start on, less its KV pool, while serving a batch of the size the planner expects the budget to
        hold (an engine whose pool is allocated at start also keeps buffers per sequence and per step beside it:
        vLLM's were tens of MiB more at 8 sequences than at one), or one request where the cache and activations
        grow with the batch (static batching: those are what the budget is for). Its wall is that plus the
        budget (or ``--memory`` for every engine)."""
        from kvbench.planner import engine_rules
        from kvbench.selfcheck.optimisation.trials import Phase, spec_for

        batch = 1
        if engine_rules(config.engine).pool_at_start:
            batch = max(1, tables.planned(config_record(config), scale_record(self.scale), CALIBRATION_WALL)["held"])
        spec = spec_for(config, self.model, self.scale, batch, CALIBRATION_WALL)
        phases = [Phase("calibrate", self.prompts.batch(batch, self.scale.prompt_tokens, self.scale.output_tokens))]
        r = self.trial(f"calibrate-{config.engine}", "calibrate", config, "calibrate", batch, spec, phases, "calibrate")
        if r["verdict"] != "ran" or r["resident_peak_bytes"] is None:
            raise SystemExit(f"{config.engine} did not serve {batch} request(s) in a {format_bytes(CALIBRATION_WALL)} "
                             f"wall: {r['exit'] or r['verdict']} (log {self.log_dir / (r['trial'] + '.log')})")
        idle = r["resident_peak_bytes"] - (r["kv_pool_bytes"] or 0)
        wall = self.memory or ceil_mib(idle + self.scale.budget_bytes)
        self.walls[config.engine] = {"idle_bytes": idle, "wall_bytes": wall, "trial": r["trial"], "batch": batch}
        self.say(f"{config.engine}: idle {idle / MIB:.1f} MiB, wall {format_bytes(wall)}")
        return self.walls[config.engine]

    def wall(self, config: Config) -> int:
        return (self.walls.get(config.engine) or self.calibrate(config))["wall_bytes"]

    # --- the columns ---------------------------------------------------------------------------------
    def capacity(self, column: Column, config: Config, max_rungs: int) -> None:
        """The ladder of batches for one configuration, from the planner's answer at its wall."""
        wall = self.wall(config)
        predicted = tables.planned(config_record(config), scale_record(self.scale), wall)["held"]
        step = max(1, math.ceil(max(predicted, 1) / 6))
        batch, verdicts = max(1, predicted), {}
        for _ in range(max_rungs):
            verdicts[batch] = self.rung(column, config, batch, wall)
            ran = verdicts[batch] == "ran"
            nxt = batch + step if ran else batch - step
            if nxt < 1 or nxt in verdicts:
                break
            if any(v == "ran" for b, v in verdicts.items() if b < batch) and not ran:
                break  # bracketed from below: a smaller batch ran, this one did not
            if any(v != "ran" for b, v in verdicts.items() if b > batch) and ran:
                break
            batch = nxt

    def rung(self, column: Column, config: Config, batch: int, wall: int) -> str:
        from kvbench.selfcheck.optimisation.trials import Phase, spec_for

        s = self.scale
        spec = spec_for(config, self.model, s, batch, wall)
        phases = []
        if config.prefix_tokens:  # the prefix computed once (and cached) before the batch that shares it
            phases.append(Phase("warm", self.prompts.batch(1, s.prompt_tokens, s.output_tokens, config.prefix_tokens,
                                                           logprobs=False, tag="warm")))
        phases.append(Phase("batch", self.prompts.batch(batch, s.prompt_tokens, s.output_tokens, config.prefix_tokens),
                            watch=True))
        longest = config.reserve or min(batch * s.request_tokens, s.model_limit)
        if not config.prefix_tokens:
            phases.append(Phase("longest", self.prompts.batch(1, longest - s.output_tokens, s.output_tokens,
                                                              logprobs=False, tag="long")))
        trial_id = f"{column.key}-{config.key}-b{batch}"
        return self.trial(trial_id, column.key, config, "rung", batch, spec, phases, "batch",
                          longest_tokens=longest)["verdict"]

    def arrivals(self, column: Column, config: Config) -> None:
        """The same arrivals (mixed output lengths, more than the slots) on the configuration and its baseline."""
        from kvbench.selfcheck.optimisation.trials import Phase, spec_for

        s = self.scale
        for c in (config, column.baseline(config)):
            room = s.prompt_tokens + max(column.output_mix)
            spec = spec_for(c, self.model, s, column.concurrency, self.wall(c), room)
            prompts = self.prompts.batch(column.requests, s.prompt_tokens, list(column.output_mix), logprobs=False,
                                         tag="a")
            self.trial(f"{column.key}-{c.key}", column.key, c, "arrivals", column.concurrency, spec,
                       [Phase("arrivals", prompts, watch=True)], "arrivals")

    def speculation(self, column: Column, config: Config) -> None:
        """Copied passages (a drafter can guess what follows) on the configuration with and without its drafter."""
        from kvbench.selfcheck.optimisation.trials import Phase, spec_for

        s = self.scale
        for c in (config, column.baseline(config)):
            spec = spec_for(c, self.model, s, column.concurrency, self.wall(c), s.prompt_tokens + column.output_tokens)
            prompts = self.prompts.copied(column.requests, s.prompt_tokens, column.output_tokens)
            r = self.trial(f"{column.key}-{c.key}", column.key, c, "speculation", column.concurrency, spec,
                           [Phase("speculation", prompts, watch=True)], "speculation")
            reqs = [json.loads(line) for line in (self.out / r["requests_file"]).read_text().splitlines()]
            drafted = sum(q.get("spec_draft_tokens") or 0 for q in reqs)
            accepted = sum(q.get("spec_accepted_tokens") or 0 for q in reqs)
            r["spec"] = {"drafted": drafted, "accepted": accepted,
                         "acceptance": accepted / drafted if drafted else None}
            self.save()


def scale_record(s: Scale) -> dict:
    return {"model": s.model, "engines": list(s.engines), "budget_bytes": s.budget_bytes,
            "request_tokens": s.request_tokens, "output_tokens": s.output_tokens, "limit": s.limit,
            "model_limit": s.model_limit}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "load_average": list(os.getloadavg())}


def render(run: dict, trials: list[dict], requests: dict[str, list[dict]]) -> str:
    """table.md: the command, the scale, the summary in the articles' layout, the details with the planner, the
    walls, and the articles' scenario planned."""
    s = run["scale"]
    cells = tables.assemble(run, trials, requests)
    return "\n".join([
        f"`{run['command']}`", "",
        f"Model {s['model']}; requests of {s['request_tokens']:,} tokens ({s['request_tokens'] - s['output_tokens']:,} "
        f"prompt + {s['output_tokens']} output, natural text, greedy); budget {format_bytes(s['budget_bytes'])} above "
        f"each engine's idle footprint; a contiguous slot reserves {s['limit']:,} tokens (the per-request limit); "
        f"the model's limit {s['model_limit']:,}. {len(trials)} trials in {run.get('seconds', 0) / 60:.1f} min.", "",
        tables.summary_table(run, cells), "", "Per configuration, with the planner's answer for the same budget "
        "above its own idle footprint (`kvbench plan --memory IDLE+BUDGET --engine E --kv-dtype D --engine-option "
        "...`: its weights and fixed overhead, overheads.toml, no margin) and at the trial's wall itself "
        "(`--memory WALL`):", "",
        tables.details_table(run, cells), "", "The walls:", "", tables.walls_text(run), "",
        "The articles' scenario (a 70B model at 4 bits on one 80 GB GPU), planned by kvbench "
        "(`kvbench plan llama-3.1-70b --weights-dtype int4 --gpu H100-80GB -n LEN --engine E --kv-dtype D`):", "",
        tables.scenario_table(tables.scenario()), ""])


def read_folder(folder: Path) -> tuple[dict, list[dict], dict[str, list[dict]]]:
    run = json.loads((folder / "run.json").read_text())
    trials = [json.loads(line) for line in (folder / "trials.jsonl").read_text().splitlines() if line.strip()]
    requests = {}
    for t in trials:
        path = folder / t["requests_file"]
        if path.exists():
            requests[t["trial"]] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return run, trials, requests


def parse_settings(pairs: list[str]) -> dict[str, dict]:
    """``--set COLUMN.SETTING=VALUE`` pairs (a VALUE that reads as JSON is taken as such: 8, [8, 64], "x")."""
    out: dict[str, dict] = {}
    for pair in pairs:
        target, _, value = pair.partition("=")
        column, _, name = target.partition(".")
        if not name or column not in registered():
            raise SystemExit(f"--set {pair!r}: want COLUMN.SETTING=VALUE, COLUMN one of {', '.join(registered())}")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        out.setdefault(column, {})[name] = parsed
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="the model (kvbench run --model's forms; default the "
                                                             "embedded SmolLM2-135M)")
    parser.add_argument("--engines", default="hf,vllm,llamacpp")
    parser.add_argument("--budget", default="48M", help="memory for requests above each engine's idle footprint")
    parser.add_argument("--memory", default=None, help="one wall for every engine instead of idle + budget")
    parser.add_argument("--request-tokens", type=int, default=256, help="N: prompt + output of a request")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--limit", type=int, default=2048, help="the per-request limit a contiguous slot reserves")
    parser.add_argument("--columns", default=",".join(registered()), help="which columns (the ones before a column "
                                                                         "still shape its configurations)")
    parser.add_argument("--set", action="append", default=[], metavar="COLUMN.SETTING=VALUE",
                        help="a column's setting, e.g. continuous.concurrency=8, prefix.prefix_tokens=128")
    parser.add_argument("--max-rungs", type=int, default=MAX_RUNGS, help="starts per ladder at most")
    parser.add_argument("--out", type=Path, default=None, help="the folder for run.json, trials.jsonl, requests/, "
                                                               "table.md and the plot")
    parser.add_argument("--log-dir", type=Path, default=None, help="the engines' logs (a temporary folder)")
    parser.add_argument("--table-from", type=Path, default=None, help="redo table.md and the plot of a folder this "
                                                                      "command wrote (and print it), starting no engine")
    args = parser.parse_args(argv)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731

    if args.table_from:
        run, trials, requests = read_folder(args.table_from)
        text = render(run, trials, requests)
        atomic_write_text(args.table_from / "table.md", text + "\n")
        print(text)
        from kvbench.selfcheck.optimisation.plot import plot

        plot(run, tables.assemble(run, trials, requests), args.table_from / "held.png")
        return 0

    from kvbench.backends import gguf_converter
    from kvbench.common import models

    command = "python -m kvbench.selfcheck.optimisation_table " + shlex.join(argv if argv is not None else sys.argv[1:])
    model = models.resolve(args.model, gguf_converter())
    engines = tuple(args.engines.split(","))
    scale = Scale(args.model, engines, parse_size(args.budget), args.request_tokens, args.output_tokens, args.limit,
                  model.geometry.max_context or 8192)
    columns = build_columns(scale, args.columns.split(","), parse_settings(args.set))
    out = args.out or Path(tempfile.mkdtemp(prefix="kvbench-opt-"))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvbench-opt-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"results in {out}, logs in {log_dir}")
    t0 = time.monotonic()
    run_state = Run(scale, model, out, log_dir, say, parse_size(args.memory) if args.memory else None)
    started = machine()
    desc = {"command": command.strip(), "scale": scale_record(scale), "columns": describe(scale, columns),
            "walls": run_state.walls, "machine": started, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for column, configs in columns:
        for config in configs:
            if column.kind == "capacity":
                run_state.capacity(column, config, args.max_rungs)
            elif column.kind == "arrivals":
                run_state.arrivals(column, config)
            else:
                run_state.speculation(column, config)
    desc["seconds"] = round(time.monotonic() - t0)
    desc["load_average_at_end"] = list(os.getloadavg())
    atomic_write_text(out / "run.json", json.dumps(desc, indent=1) + "\n")
    run, trials, requests = read_folder(out)
    text = render(run, trials, requests)
    atomic_write_text(out / "table.md", text + "\n")
    print(text)
    from kvbench.selfcheck.optimisation.plot import plot

    plot(run, tables.assemble(run, trials, requests), out / "held.png")
    if run_state.survivors:
        print(f"processes survived a stop: {run_state.survivors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
