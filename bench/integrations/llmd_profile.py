"""What kvbench's llm-d-benchmark harness is told: the harness pod's environment and the rendered profile,
read and checked, and the ``kvbench run`` command they make (the harness itself: llmd_harness.py).

The profile is YAML, rendered by llm-d-benchmark from a ``.yaml.in`` template (its ``REPLACE_ENV_`` tokens);
an experiment's treatments override its keys by dotted path::

    endpoint: http://...        # the server: -b ENGINE:url=ENDPOINT
    model: org/name             # --model
    engine: {vllm-prod: vllm, llm-d: openai}  # the kvbench engine, by LLMDBENCH_HARNESS_STACK_TYPE (or one name)
    engine_options: {}          # more -b options, KEY: VALUE
    workload: {...}             # a kvbench workload: its settings (a workload file's keys), or its name
    run: {}                     # more kvbench run flags by their long name: request-timeout: 300
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from kvbench.common import outside
from kvbench.common.files import PlainNameError, atomic_write_text, check_plain_name
from kvbench.common.suggest import closest
from kvbench.kv import bounded

HARNESS = "kvbench"
RUNS_FOLDER = "kvbench_runs"  # kvbench's run folders, inside the results folder
WORKLOAD_FILE = "kvbench_workload.toml"  # a profile's workload settings, as kvbench run --workload reads them
PROFILE_MAX_BYTES = 1 << 20
PROFILE_MAX_DEPTH = 16
#: kvbench run's flags the harness gives itself (a profile's run: may not)
HARNESS_FLAGS = ("backend", "url", "model", "workload", "results-dir", "run-id", "resume", "overwrite")
TOKEN = re.compile(r"REPLACE_ENV_\w+")  # an llm-d-benchmark template token left unrendered


class HarnessError(ValueError):
    """A refusal of the environment or the profile: one line, exit 2."""


# --- the environment -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Environment:
    """What llm-d-benchmark tells its harness pod, read from the environment once."""

    results_dir: Path
    workload_name: str
    workspace: Path = Path("/workspace")
    harness_name: str = HARNESS
    model: str = ""
    endpoint: str = ""
    stack_type: str = ""
    experiment_id: str = ""
    pod_uid: str = ""
    description: str = ""
    keywords: tuple[str, ...] = ()
    namespace: str = ""
    scrape_metrics: bool = False

    @classmethod
    def read(cls, environ) -> "Environment":
        results = environ.get("LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR", "").strip()
        if not results:
            raise HarnessError("LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR is not set: llm-d-benchmark's harness pod "
                               "sets it (the folder the results go to)")
        workload = environ.get("LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME", "").strip()
        if not workload:
            raise HarnessError("LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME is not set: the profile to run "
                               "(e.g. sanity_random.yaml)")
        if not workload.endswith(".yaml"):  # llm-d-benchmark's entrypoint names it so too
            workload += ".yaml"
        harness = environ.get("LLMDBENCH_HARNESS_NAME", "").strip() or HARNESS
        try:  # both are joined to folders: a path would read or write outside them
            check_plain_name(workload, "LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME")
            check_plain_name(harness, "LLMDBENCH_HARNESS_NAME")
        except PlainNameError as exc:
            raise HarnessError(str(exc)) from None
        workspace = Path(environ.get("LLMDBENCH_RUN_WORKSPACE_DIR", "").strip() or "/workspace")
        environ = _Texts(environ)  # the rest is text kept in the reports and run_metadata.yaml (paths stay bytes)
        keywords = environ.get("LLMDBENCH_DESCRIPTION_KEYWORDS", "")
        return cls(
            results_dir=Path(results), workload_name=workload, workspace=workspace,
            harness_name=harness,
            model=environ.get("LLMDBENCH_DEPLOY_CURRENT_MODEL", "").strip(),
            endpoint=environ.get("LLMDBENCH_HARNESS_STACK_ENDPOINT_URL", "").strip(),
            stack_type=environ.get("LLMDBENCH_HARNESS_STACK_TYPE", "").strip(),
            experiment_id=environ.get("LLMDBENCH_RUN_EXPERIMENT_ID", "").strip(),
            pod_uid=environ.get("POD_UID", "").strip(),
            description=environ.get("LLMDBENCH_DESCRIPTION_TEXT", "").strip(),
            keywords=tuple(k.strip() for k in keywords.split(",") if k.strip()),
            namespace=environ.get("LLMDBENCH_VLLM_COMMON_NAMESPACE", "").strip(),
            scrape_metrics=environ.get("LLMDBENCH_VLLM_COMMON_METRICS_SCRAPE_ENABLED", "").strip().lower() == "true")

    @property
    def profile_path(self) -> Path:
        return self.workspace / "profiles" / self.harness_name / self.workload_name


class _Texts:
    """The environment's values as text every writer takes: a byte that is not UTF-8 (which Python keeps as a
    lone surrogate, and which made every Benchmark Report of a finished run fail to be written) read as
    U+FFFD (kvbench.common.outside)."""

    def __init__(self, environ):
        self.environ = environ

    def get(self, key: str, default: str = "") -> str:
        value = self.environ.get(key, default)
        return default if value is None else outside.text(value, limit=None)


# --- the profile -----------------------------------------------------------------------------------------

Scalar = Union[StrictBool, StrictInt, StrictFloat, StrictStr]


class Profile(BaseModel):
    """A rendered profile (the module's docstring shows one)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: StrictStr
    model: StrictStr
    engine: Union[StrictStr, dict[str, StrictStr]]  # one engine, or one per stack type
    engine_options: dict[str, Scalar] = {}
    workload: Union[StrictStr, dict[str, Any]]
    run: dict[str, Union[Scalar, list[Scalar]]] = {}


def read_profile(env: Environment) -> tuple[Profile, bytes]:
    """The profile and its bytes; :class:`HarnessError` naming what is wrong with it."""
    where = f"profile {env.profile_path}"
    try:
        raw = bounded.read_bytes(env.profile_path, PROFILE_MAX_BYTES, what="profile")
    except (bounded.InputError, OSError) as exc:
        raise HarnessError(f"{exc} (llm-d-benchmark mounts the rendered profiles of harness "
                           f"{env.harness_name} there)") from None
    try:  # bounded: 16 levels, no alias bomb (620 bytes of nested aliases held the harness for ever)
        data = bounded.parse_yaml(raw, env.profile_path, "profile", max_depth=PROFILE_MAX_DEPTH)
    except bounded.InputError as exc:
        raise HarnessError(str(exc)) from None
    if not isinstance(data, dict):
        raise HarnessError(f"{where} is not a mapping of keys (endpoint, model, engine, workload, ...)")
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'profile'}: {e['msg']}" for e in exc.errors())
        raise HarnessError(f"{where}: {problems}") from None
    for key in ("endpoint", "model"):
        value = getattr(profile, key).strip()
        if not value or TOKEN.search(value):
            raise HarnessError(f"{where}: {key} is {value!r}: llm-d-benchmark did not render it (run the profile "
                               f"through its run step, or give the {key} in the profile)")
    return profile, raw


def engine_of(profile: Profile, env: Environment) -> str:
    """The profile's engine, or the one it names for the stack llm-d-benchmark says it stood up."""
    if isinstance(profile.engine, str):
        return profile.engine
    if env.stack_type not in profile.engine:
        raise HarnessError(f"engine: the profile names one for the stack types {', '.join(profile.engine)}, and "
                           f"LLMDBENCH_HARNESS_STACK_TYPE is {env.stack_type or 'not set'}: add it, or give one "
                           "engine (engine: NAME)")
    return profile.engine[env.stack_type]


def _option_text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def backend_argument(profile: Profile, engine: str) -> str:
    """``-b ENGINE:url=ENDPOINT,KEY=VALUE,...`` (kvbench checks the engine and its options)."""
    parts = [f"{engine}:url={profile.endpoint.strip()}"]
    for key, value in profile.engine_options.items():
        if key == "url":
            raise HarnessError("engine_options.url: the endpoint is the profile's endpoint")
        text = _option_text(value)
        if "," in text or "," in key or "=" in key:
            raise HarnessError(f"engine_options.{key}: a key or value with ',' or a key with '=' cannot be "
                               "passed as a -b option")
        parts.append(f"{key}={text}")
    return ",".join(parts)


def run_flags(run: dict, notes: list[str]) -> list[str]:
    """The profile's ``run:`` as kvbench run flags, each checked against kvbench run's own (bench/run/options.py).
    A value that is an unrendered llm-d-benchmark token (a plan without maxModelLen, say) is left out, and said."""
    from kvbench.run.option_fields import flags
    from kvbench.run.options import RunOptions

    known = {}
    for flag in flags(RunOptions):
        long = next((n for n in flag.names if n.startswith("--")), "--" + flag.param.replace("_", "-"))
        known[long[2:]] = flag
    out: list[str] = []
    for key, value in run.items():
        if key in HARNESS_FLAGS:
            raise HarnessError(f"run.{key}: the harness sets --{key} itself (from the profile's endpoint, model and "
                               "workload, and the results folder)")
        if key not in known:
            hint = closest(key, [k for k in known if k not in HARNESS_FLAGS])
            raise HarnessError(f"run.{key} is not a kvbench run flag" + (f"; did you mean {hint!r}?" if hint else
                               f" (known: {', '.join(sorted(k for k in known if k not in HARNESS_FLAGS))})"))
        flag = known[key]
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and TOKEN.fullmatch(item.strip()):
                notes.append(f"run.{key} is {item}, which llm-d-benchmark did not render: left to kvbench's default")
                continue
            if flag.kind is bool:
                if not isinstance(item, bool):
                    raise HarnessError(f"run.{key} is a switch: true or false, not {item!r}")
                if item:
                    out.append(f"--{key}")
                elif flag.default:
                    out.append(f"--no-{key}")
                continue
            if isinstance(item, bool):
                raise HarnessError(f"run.{key} takes a value, not {_option_text(item)}")
            out += [f"--{key}", str(item)]
    return out


def workload_argument(profile: Profile, env: Environment) -> str:
    """``--workload``: the profile's workload name or path, or its settings written as a workload file."""
    if isinstance(profile.workload, str):
        if TOKEN.search(profile.workload):
            raise HarnessError(f"workload is {profile.workload!r}: llm-d-benchmark did not render it")
        return profile.workload
    import tomli_w

    try:
        text = tomli_w.dumps(profile.workload)
    except (TypeError, ValueError) as exc:  # a null, or a value TOML has no form for
        raise HarnessError(f"workload: its settings have no TOML form ({exc}); give numbers, strings, booleans, "
                           "lists of them and the load table") from None
    if TOKEN.search(text):
        raise HarnessError(f"workload: {TOKEN.search(text).group(0)} was not rendered by llm-d-benchmark")
    path = env.results_dir / WORKLOAD_FILE
    atomic_write_text(path, f"# the workload of profile {env.workload_name}, written by kvbench's harness\n{text}")
    return str(path)


def run_id(env: Environment) -> str:
    """kvbench's run id: the results folder's name (llm-d-benchmark's ``<experiment id>_<pod index>``, so each
    parallel pod's reports have their own ``run.uid``), made a plain name."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", env.results_dir.name).lstrip(".")[:180]
    return name or HARNESS


def run_folder(env: Environment) -> Path:
    """A new run folder: the first try's is the run id's; a retry (llm-d-benchmark retries a failed harness
    in the same results folder) gets ``<id>_try2``, ``<id>_try3``, ..., and the earlier tries stay as they are."""
    runs = env.results_dir / RUNS_FOLDER
    base, n = run_id(env), 1
    while (runs / (base if n == 1 else f"{base}_try{n}")).exists():
        n += 1
    return runs / (base if n == 1 else f"{base}_try{n}")


def kvbench_executable() -> str:
    """The ``kvbench`` beside this Python (the harness image's virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / "kvbench"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("kvbench")
    if not found:
        raise HarnessError(f"no kvbench command beside {sys.executable} or on PATH")
    return found


def kvbench_command(profile: Profile, env: Environment, workload: str, run_dir: Path, notes: list[str]) -> list[str]:
    return [kvbench_executable(), "run", "--backend", backend_argument(profile, engine_of(profile, env)),
            "--model", profile.model.strip(), "--workload", workload, "--results-dir", str(run_dir.parent),
            "--run-id", run_dir.name, *run_flags(profile.run, notes)]
