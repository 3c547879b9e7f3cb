"""The user's MODEL argument as a geometry and weights: a config.json, a model folder, a GGUF file, the
embedded model, a catalog name or a hub id (org/name, through huggingface_hub and its cache, after a short
probe of the hub so that no network answers within about a second, from the cache).

The weights of an HF checkpoint come from one place, :func:`checkpoint_weights`, which asks
``kvbench.kv.weights.for_model`` (exact from the files, else the config's estimate; a quantised
checkpoint's own widths from its quantization_config). The width an engine serves an unquantised
checkpoint at is the engine's (:meth:`KVRules.serving_dtype`): :func:`served_weights` asks for it.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.kv import hub, weights
from kvbench.kv.startup import ModelWidths
from kvbench.kv.geometry import KVGeometry
from kvbench.kv.model_config import (
    ConfigError,
    config_file,
    geometry_from_gguf_keys,
    gguf_keys,
    parse_hf_dict,
    read_json,
    refuse_unread,
    unread_keys,
)
from kvbench.kv.rules import KVRules
from kvbench.kv.weights import WEIGHT_DTYPE_BYTES, Weights

from .shared import CATALOG_DIR, PlanError, catalog_names

HUB_PROBE_S = 1.0  # how long the hub may take to accept a connection before the cache is used instead
WEIGHT_DTYPES = ("auto", *WEIGHT_DTYPE_BYTES)  # what --weights-dtype takes


@dataclass(frozen=True)
class ModelForPlan:
    name: str
    geometry: KVGeometry
    weights: Weights  # as the checkpoint stores them (or at --weights-dtype, or --weights-bytes)
    source: str = ""  # where the model was read from (a path, the catalog, the hub)
    weights_dtype: str = "auto"  # "auto": each engine serves an unquantised checkpoint at its own dtype
    # the checkpoint's weights at another width (a dtype name): None where the figure cannot change
    # (a GGUF's own tensors, --weights-bytes)
    weights_at: Callable[[str], Weights] | None = field(default=None, compare=False, repr=False)
    unread_keys: tuple[str, ...] = ()  # per-layer-looking config keys the KV reader did not read
    # a GGUF's weights as the engines that serve HF folders hold them: the HF-format copy kvbench converts it to
    hf_copy: Callable[[], Weights] | None = field(default=None, compare=False, repr=False)
    # the widths an engine's activation peak scales with (hidden, MLP, vocab, experts): None where unread
    widths: ModelWidths | None = field(default=None, compare=False)
    # the routed experts' share of the checkpoint's bytes (counted from the config; None: dense or uncounted)
    expert_share: Callable[[], float | None] | None = field(default=None, compare=False, repr=False)
    # the config's multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers): an MTP drafter's
    mtp_layers: int = 0

    @property
    def weights_bytes(self) -> float | None:
        return self.weights.bytes

    @property
    def weights_source(self) -> str:
        return self.weights.source

    @property
    def verified(self) -> bool:
        return not self.unread_keys and not self.geometry.assumed

    @property
    def unverified_reason(self) -> str:
        """Why the answer is not verified, in a few words ("" where it is)."""
        why = []
        for name in self.geometry.assumed:  # its note: "<name> is not in the file: <Class> gives <value>, ..."
            note = next((n for n in self.geometry.notes if n.startswith(f"{name} is not in the file: ")), "")
            given = note.split(": ", 1)[1].split(", ", 1)[0] if note else "its class fills it"
            why.append(f"{name} not in the config ({given})")
        if self.unread_keys:
            why.append(f"the config's {', '.join(self.unread_keys)} look per-layer and were not read")
        return "; ".join(why)

    @property
    def quantised(self) -> str | None:
        """The checkpoint's quantisation method (its quantization_config), None for a plain checkpoint."""
        return next((f.split("=", 1)[1] for f in self.geometry.flags if f.startswith("quant_method=")), None)


# --- the weights ----------------------------------------------------------------------------------------

def checkpoint_weights(source: Path, raw: dict, config, text, weights_dtype: str) -> Weights:
    """THE place an HF checkpoint's weights come from: ``kvbench.kv.weights.for_model`` (exact from the
    safetensors or the index, a catalog's published count, else the config's estimate; a quantised
    checkpoint, e.g. DeepSeek-V3's FP8, at the widths its quantization_config gives). ``weights_dtype``
    "auto" is the checkpoint's own width; another is the width an engine loads it at."""
    try:
        return weights.for_model(source, config, text, raw=raw, weights_dtype=weights_dtype)
    except ImportError as exc:  # the quantised-checkpoint pricing is not installed here
        return Weights(None, f"unknown: this checkpoint's quantised weights could not be priced ({exc}); give "
                             "--weights-bytes", method="unknown")


def expert_share(config, text) -> float | None:
    """The routed experts' share of a checkpoint's bytes, from the config's count at its stored widths (what
    data-parallel attention spreads over every GPU); None for a dense model or a count that fails."""
    try:
        found = weights.estimate(text, config, "bf16")
    except (ImportError, TypeError, ValueError):
        return None
    total, routed = sum(found.breakdown.values()), found.breakdown.get("experts", 0)
    # an MTP layer is experts too (DeepSeek's): counted with them, as the figure it is a share of holds it
    return (routed + found.breakdown.get("mtp", 0)) / total if total and routed else None


def served_weights(model: ModelForPlan, rules: KVRules, capability: tuple[int, int] | None) -> Weights:
    """The weights as the engine holds them: a quantised checkpoint, a GGUF, --weights-bytes or
    --weights-dtype as they are; an unquantised checkpoint at the engine's serving dtype (vLLM serves a
    float32 config in bf16, transformers in float32)."""
    w = model.weights
    if rules.model_format == "safetensors" and model.hf_copy is not None and w.method != "user":
        return model.hf_copy()
    if model.weights_at is None or model.weights_dtype != "auto" or model.quantised or w.bytes is None:
        return w
    served = rules.serving_dtype(model.geometry, capability)
    stored = {"fp32": 4, "fp16": 2}.get(model.geometry.dtype or "", 2)
    if WEIGHT_DTYPE_BYTES[served] == stored:
        return w
    at = model.weights_at(served)
    if at.bytes is None:
        return w
    return Weights(at.bytes, f"{at.source.replace(f'--weights-dtype {served}:', 'estimate:')} [served in {served}: "
                             f"{rules.serving_note(model.geometry, capability)}]", exact=False,
                   parameters=at.parameters, method=at.method)


@functools.lru_cache(maxsize=8)
def hf_copy_weights(gguf: Path) -> Weights:
    """A GGUF's weights as an engine serving HF folders holds them: the safetensors of the HF-format copy
    kvbench converts it to (exact, once it is made), else the GGUF's parameters at bf16 (the copy's width)."""
    from kvbench.common.models import hf_copy_dir

    folder = hf_copy_dir(gguf)
    if (folder / "config.json").exists():
        copy = resolve_model(str(folder)).weights
        if copy.bytes is not None:
            return Weights(copy.bytes, f"the HF-format copy kvbench made of {gguf.name}: {copy.source}",
                           exact=copy.exact, parameters=copy.parameters, method=copy.method)
    params = weights.gguf_parameters(gguf)
    return Weights(params * 2.0, f"estimate: {gguf.name}'s {params / 1e6:,.1f} M parameters at bf16, the HF-format "
                                 "copy kvbench converts it to (not made yet here)", exact=False, parameters=params,
                   method="gguf parameters")


# --- the hub --------------------------------------------------------------------------------------------

def hub_reachable(repo_id: str = "", timeout: float = HUB_PROBE_S) -> bool:
    """Whether the hub endpoint (HF_ENDPOINT) answers an HTTP request (any status: 404 and 401 are answers)
    within ``timeout`` seconds, name resolution and a connection that opens but never answers included
    (the request runs in a thread that is not waited for past the timeout)."""
    import httpx
    from huggingface_hub import constants

    url = f"{constants.ENDPOINT}/{repo_id}/resolve/main/config.json" if repo_id else constants.ENDPOINT
    answer = []

    def probe():
        try:
            httpx.head(url, timeout=timeout, follow_redirects=False)
            answer.append(True)
        except (httpx.HTTPError, OSError, ValueError):
            answer.append(False)
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.2)
    return bool(answer and answer[0])


@contextmanager
def _offline():
    """huggingface_hub's offline mode for the calls inside (it reads the cache only)."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def hub_folder(repo_id: str) -> Path:
    """The model's config folder in the hub cache: fetched when the hub answers the probe, else from the
    cache in offline mode (so that a machine without network answers within about a second)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or hub_reachable(repo_id):
        try:
            return hub.config_folder(repo_id)
        except hub.HubError as exc:
            raise PlanError(str(exc)) from None
    try:
        with _offline():
            return hub.config_folder(repo_id)
    except hub.HubError:
        raise PlanError(f"{repo_id} is not in the local hub cache ({constants.HF_HUB_CACHE}) and the hub could not "
                        f"be reached ({constants.ENDPOINT} did not answer within {HUB_PROBE_S:g} s): download it "
                        f"once where the hub is reachable (hf download {repo_id}), or give a local folder") from None


# --- the model ------------------------------------------------------------------------------------------

def resolve_model(model: str, weights_dtype: str = "auto", trust_remote_code: bool = False,
                  weights_bytes: float | None = None) -> ModelForPlan:
    """MODEL as a config.json, an HF model folder, a GGUF file, the embedded model (smollm2), a catalog name
    or a hub id (org/name). ``weights_dtype``: "auto" or a width to count the weights at;
    ``weights_bytes``: the user's own figure (--weights-bytes), which wins."""
    from kvbench.common.models import EMBEDDED, ModelError, embedded_gguf

    if weights_dtype not in WEIGHT_DTYPES:
        raise PlanError(f"unknown weights dtype {weights_dtype!r}; known: {', '.join(WEIGHT_DTYPES)}")
    path = Path(model).expanduser()
    source = str(path)
    if not path.exists():
        if model in EMBEDDED:
            try:
                path, source = embedded_gguf(model), f"embedded {model}"
            except ModelError as exc:
                raise PlanError(str(exc)) from None
        elif (CATALOG_DIR / f"{model}.json").exists():
            path, source = CATALOG_DIR / f"{model}.json", f"catalog {model}"
        elif model.startswith(("/", "./", "../", "~")) or path.suffix in (".json", ".gguf"):
            raise PlanError(f"no such file or folder: {path}")
        elif hub.looks_like_hub_id(model):
            path, source = hub_folder(model), f"hub {model}"
        else:
            raise PlanError(f"{model!r} is not a file or folder, a hub id (org/name), the embedded model "
                            f"({', '.join(EMBEDDED)}) or a catalog model; catalog: {', '.join(catalog_names())}")
    given = None
    if weights_bytes is not None:
        given = Weights(float(weights_bytes), f"given: --weights-bytes {weights_bytes / 2**30:,.2f} GiB", exact=True,
                        method="user")
    try:
        if path.suffix == ".gguf":
            name = model if model in EMBEDDED else path.stem
            return ModelForPlan(name, geometry_from_gguf_keys(gguf_keys(path), str(path)),
                                given or Weights(weights.gguf_tensor_bytes(path), "GGUF tensor bytes", exact=True),
                                source, weights_dtype, hf_copy=lambda: hf_copy_weights(path))
        file = config_file(path)
        if not file.exists():
            raise PlanError(f"{path} has no config.json")
        raw = read_json(file)
        folder = path if path.is_dir() else path.parent
        config, text, geometry = parse_hf_dict(raw, str(file), folder, trust_remote_code)
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    name = model if source.startswith("hub") else (path.name if path.is_dir() else path.stem)
    unread = tuple(unread_keys(raw, text))
    try:
        refuse_unread(unread, str(file))
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    widths = ModelWidths.from_config(text)
    nextn = getattr(text, "num_nextn_predict_layers", None) or raw.get("num_nextn_predict_layers")
    mtp = nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and 0 < nextn <= 64 else 0
    if given is not None:
        return ModelForPlan(name, geometry, given, source, weights_dtype, None, unread, widths=widths, mtp_layers=mtp)

    def at(dtype: str) -> Weights:
        return checkpoint_weights(path, raw, config, text, dtype)
    return ModelForPlan(name, geometry, at(weights_dtype), source, weights_dtype, at, unread, widths=widths,
                        expert_share=functools.cache(functools.partial(expert_share, config, text)), mtp_layers=mtp)


def build_speculation(model: ModelForPlan, rules: KVRules, capability: tuple[int, int] | None, method: str,
                      draft: ModelForPlan | None, tokens: int | None, draft_label: str = ""):
    """The drafter ``method`` runs beside ``model`` (kvbench plan --speculative): its layers and its weights as the
    engine of ``rules`` serves them (a draft model's own, an EAGLE head's one layer of the target's shape, the
    config's MTP layers, whose weights the checkpoint already holds)."""
    from kvbench.kv.speculative import Speculation, mtp_head, one_layer_head

    if method == "ngram":
        return Speculation("ngram", tokens, None, "", 0.0, "no drafter weights (n-gram lookup)", head="n-gram lookup")
    if method == "mtp":
        if not model.mtp_layers:
            raise PlanError("--speculative mtp: the config has no multi-token-prediction layers "
                            "(num_nextn_predict_layers)")
        mtp = model.weights.breakdown.get("mtp") if model.weights.breakdown else None
        why = (f"the checkpoint's total already holds them (about {mtp / 2**30:.2f} GiB, loaded only to speculate)"
               if mtp else "in the checkpoint's total (its MTP layers are part of its files)")
        return Speculation("mtp", tokens, mtp_head(model.geometry, model.mtp_layers), "", 0.0, why, model.widths,
                           head=f"the config's {model.mtp_layers} MTP layer(s)")
    if draft is None:
        if method == "draft":
            raise PlanError("--speculative draft needs --draft-model (a catalog name, config folder or file)")
        w = served_weights(model, rules, capability).bytes
        layers = max(1, model.geometry.num_layers)
        return Speculation("eagle", tokens, one_layer_head(model.geometry), "", None if w is None else w / layers,
                           f"estimate: one decoder layer's share of the target's weights (1/{layers}); give the "
                           "head's config as --draft-model for its own", model.widths,
                           head="one decoder layer of the target's shape")
    w = served_weights(draft, rules, capability)
    return Speculation(method, tokens, draft.geometry, draft_label or draft.name, w.bytes,
                       f"the draft model's: {w.source}", draft.widths)
