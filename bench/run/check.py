"""Step "check" of an engine session: what the engine says of itself (version, the models it serves, its
capabilities, its tokenizer against the model's) recorded, an attached server serving another model
refused, a started one answering as another version or model refused, an engine that is not the one the
run's earlier cells ran on refused for the run, and the engine's startup figures beside the plan's
(bench/run/startup_checks.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import httpx

from kvbench.backends.base import Backend
from kvbench.backends.process import read_log
from kvbench.backends.types import EngineStartError
from kvbench.common import models, outside
from kvbench.common.redact import redact_url
from kvbench.run import startup_checks
from kvbench.store.errors import RunFolderError

if TYPE_CHECKING:
    from kvbench.run.session import EngineSession


def check(s: EngineSession, backend: Backend) -> None:
    """The version the engine reports, the models it serves (checked against --model), what it supports and
    how its prompts and tokenizer were checked, recorded. An engine that is not the one the run's other
    cells ran on (another version behind an attached URL, another build) is refused for the whole run
    (RunFolderError); a started engine that reports another version or model than it was started with is
    not the engine kvbench started (EngineStartError)."""
    # the server's words, made text every writer takes (a lone surrogate in its JSON failed the run's records)
    version = outside.optional_text(backend.reported_version(), limit=200)
    cls, label, record = type(backend), s.cfg.label, s.r.record
    build = cls.machine_build(backend.version) if not s.cfg.url else None
    _held_to_the_run(s, "version", record.engine_versions.get(label), version)
    _held_to_the_run(s, "build", record.engine_builds.get(label), build)
    if not s.cfg.url and cls.reports_started_version and cls.own_install(s.cfg.options) is None \
            and version is not None and version.split(" ")[0] != backend.version:
        raise EngineStartError(f"{backend.base_url} answers as {s.cfg.engine} {version}, not the {backend.version} "
                               f"kvbench started: not the engine kvbench started")
    record.engine_versions[label] = version
    served_model = backend.capabilities.served_model
    served = served_model.models(backend)
    record.served_models[label] = served = None if served is None else outside.texts(served, limit=400)
    record.capabilities[label] = outside.texts(served_model.support(backend), limit=outside.TEXT_MAX_CHARS)
    if build:
        record.engine_builds[label] = build
    record.save(s.r.writer)
    # a started engine serves what kvbench passed it: the model's name or a path in its command (llama.cpp
    # the GGUF its converter made of an HF folder, TGI the HF copy of the embedded GGUF)
    started_with = set(backend.server.argv) if backend.server and not s.cfg.url else set()
    if served is not None and not models.serves(served, s.spec.model, s.r.o.model) \
            and not started_with.intersection(served):
        problem = (f"the server serves {', '.join(served) or 'no model'}, not --model {s.r.o.model}: its "
                   f"figures would be set against {s.spec.model.name}'s KV")
        if not s.cfg.url:  # kvbench gave it the model: another one answering is another server
            raise EngineStartError(f"{problem}: not the engine kvbench started")
        if not s.r.o.allow_model_mismatch:
            raise EngineStartError(problem + " (--allow-model-mismatch to run anyway)")
        s.r.console.print(f"[yellow]warning: {problem} (--allow-model-mismatch)[/]")
    s.info = replace(s.info, engine_version_reported=version, token_contract=token_contract(s, backend))
    record.save(s.r.writer)


def _held_to_the_run(s: EngineSession, what: str, then: str | None, now: str | None) -> None:
    """The engine's ``what`` (its reported version, its build) as the run recorded it for this label (an
    earlier invocation, or an earlier start of this one): another one would put cells of two engines under
    one label, so the run is refused with both values."""
    if then is None or now is None or then == now:
        return
    where = f" at {redact_url(s.cfg.url)}" if s.cfg.url else ""
    resumed = "--resume: " if s.r.o.results_mode == "resume" else ""
    raise RunFolderError(f"{resumed}{s.cfg.label}{where} now reports {what} {now}; the run's cells of it ran on "
                         f"{what} {then}: resume it on that engine, or start a new run")


def token_contract(s: EngineSession, backend: Backend) -> str:
    """How prompts reach the engine and how output length is forced, plus a check of the prompt
    tokens against the engine's own tokenizer where it has a tokenize endpoint."""
    parts = ["token ids" if backend.accepts_token_ids else "text",
             "output forced" if backend.forces_output_length else "output as generated"]
    probe = s.prompts.build(64, "tokenizer-check", 1)
    try:
        ids = backend.tokenize(probe.text)
    except httpx.HTTPError as exc:
        ids, note = None, f"tokenize endpoint failed ({type(exc).__name__})"
    else:
        note = "no tokenize endpoint: checked per request by the engine's usage report"
    if ids is not None:
        if list(ids) != list(probe.token_ids):
            raise ValueError(f"the engine's tokenizer disagrees with the model's tokenizer.json: 64 prompt "
                             f"tokens became {len(ids)} ({list(ids)[:8]}... vs {list(probe.token_ids)[:8]}...)")
        note = "tokenizer checked against the engine's tokenize endpoint"
    s.r.record.token_checks[s.cfg.label] = note
    return ", ".join(parts)


def check_startup(s: EngineSession, backend: Backend, started: bool) -> None:
    """The engine's own figures at startup (its log, read by its adapter) beside the plan's for the same
    deployment (its GPU as NVML names it), into run.json's startup_checks (bench/run/startup_checks.py).
    A server kvbench did not start has no log here. A check that cannot be made is recorded as such; it
    never fails the engine's cells."""
    if s.cfg.url or s.log_path is None or not s.log_path.exists():
        return
    cls, spec = type(backend), s.spec
    try:
        figures = cls.startup_figures_from_log(read_log(s.log_path))
        if not figures:
            return
        settings = backend.startup_settings(spec)
        hf = spec.model.hf_dir
        model = settings.get("model_file") or (str(hf) if (hf / "config.json").exists() else
                                               str(spec.model.gguf_path or hf))
        base = s.gpu_baseline
        start = startup_checks.Start(
            s.cfg.engine, s.info.engine_version_reported or backend.version, model,
            cls.gpus_used(s.cfg.options), spec.max_context, settings,
            base.names[0] if base and base.names else None,
            base.device_total_bytes[0] if base and base.device_total_bytes else None, started)
        found = startup_checks.startup_check(figures, start)
    except Exception as exc:  # noqa: BLE001 - a check is a record of the run, never a reason to fail it
        found = {"error": f"{type(exc).__name__}: {exc}"}
    if found:
        s.r.record.startup_checks[s.key] = found
        s.r.record.save(s.r.writer)
