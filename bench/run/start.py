"""Step "start or attach" of an engine session: the engine's environment installed (once) and its server
started, or a server already running attached to; a deployment's replicas each attached to."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.backends.base import Backend
from kvbench.backends.deployment import Deployment
from kvbench.common.envs import EnvInstallError, ensure_env

if TYPE_CHECKING:
    from kvbench.run.session import EngineSession


def make_backend(s: EngineSession, cls) -> Backend | None:
    """The engine's adapter: installed where kvbench starts it (None: the install failed, its cells with it)."""
    if s.cfg.deployment:  # several replicas (or a gateway): one adapter attached to each
        return Deployment.of(cls, s.cfg.version, s.cfg.options, s.cfg.urls, s.cfg.gateway)
    if s.cfg.url or cls.own_install(s.cfg.options):  # attached, or the options name the engine's own install
        return cls(s.cfg.version, None, s.cfg.options)
    s.progress.update(s.bar, description=f"{s.cfg.label}: installing")
    try:
        env_path = ensure_env(cls.recipe(s.cfg.version), log=s.r.console.print)
    except EnvInstallError as exc:
        s.fail_remaining(f"install failed: {exc}", exc.log_tail)
        s.stop_reason = "install failed"
        return None
    return cls(s.cfg.version, env_path, s.cfg.options)


def start_or_attach(s: EngineSession, backend: Backend) -> None:
    """Attach to the server at the backend's url, or start one (its GPU baseline taken first, its log in the
    run folder)."""
    r, cfg = s.r, s.cfg
    backend.request_timeout_s = r.o.request_timeout_s  # a probe the adapter sends itself waits as long
    s.progress.update(s.bar, description=f"{cfg.label}: {'attaching' if cfg.url else 'starting'}")
    if cfg.url:
        backend.attach(s.spec, cfg.url, timeout_s=min(r.o.start_timeout_s, 60))
        return
    # GPU memory before the engine exists: its figures are measured against this
    s.gpu_baseline = r.nvml.idle_baseline()  # None without a GPU
    r.record.gpu_baselines[cfg.label] = s.gpu_baseline.to_dict() if s.gpu_baseline else None
    r.record.save(r.writer)
    # one log per KV dtype's start: the pool is read from the start's own log lines
    log = cfg.label + (f"_kv-{s.kv_variant}" if s.kv_variant else "")
    s.log_path = r.writer.log_path(log)
    backend.start(s.spec, s.log_path, r.o.start_timeout_s)
