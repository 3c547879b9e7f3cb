"""What every part of the planner shares: its refusal, the engines whose KV rules it knows, the catalog of
models and of GPUs, and the sizes a user types (``128K`` tokens, ``61GiB``)."""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvbench.backends import ENGINES, engines_with_rules, kv_rules
from kvbench.kv.rules import KVRules, PlainRules
from kvbench.kv.units import GIB

CATALOG_DIR = Path(__file__).with_name("catalog")
GPUS_FILE = Path(__file__).with_name("gpus.toml")
PLAIN = PlainRules()  # the plain formula, when no engine is named
#: NVML's total less CUDA's (torch.cuda.mem_get_info) for a card no log shows: fitted on the two cards
#: whose startup logs print both (H100 80GB 79.65 - 79.22, RTX 3090 24.00 - 23.58); held out, the A100 40GB
#: log (39.38 GiB) is 0.20 GiB below the 39.58 it predicts (0.5 %).
CUDA_GAP_GIB = 0.42
NODE_GPUS = 8  # GPUs one node holds: the most the tensor-parallel lever proposes (--node-gpus)


class PlanError(ValueError):
    """A plan that cannot be made: one line saying why (the CLI exits 2 with it)."""


def catalog_names() -> list[str]:
    return sorted(p.stem for p in CATALOG_DIR.glob("*.json"))


def model_names() -> list[str]:
    """The model names kvbench knows without a path or hub id (for "did you mean"): the embedded models and
    the catalog's."""
    from kvbench.common.models import EMBEDDED
    return [*EMBEDDED, *catalog_names()]


SIZE = re.compile(r"(?<![a-z\d.])(\d+(?:\.\d+)?)b(?![a-z])")  # 70b, 0.5b, 235b (of 235b-a22b)
FAMILY = re.compile(r"^[a-z-]*?([a-z]+)[-_]?v?(\d+(?:\.\d+)?)(?![\d.]*b(?![a-z]))")  # llama-3.1, qwen2.5, deepseek-v3


def model_family(name: str) -> tuple[str, str | None, str | None]:
    """(family, generation, size) of a model's name, a hub id's included: ``meta-llama/Llama-3.1-70B-Instruct``
    is ("llama", "3.1", "70"); a part the name does not say is None."""
    base = name.rsplit("/", 1)[-1].lower()
    size = SIZE.search(base)
    m = FAMILY.match(base)
    family = m[1] if m else re.match(r"[a-z]*", base)[0]
    return family, m[2] if m else None, size[1] if size else None


def similar_model(word: str, names: list[str]) -> str | None:
    """The name of ``names`` that ``word`` is a typo or a longer spelling of, only within its family, generation
    and size: ``Llama-3.1-70B-Instruct`` may be llama-3.1-70b, never llama-3-8b-instruct-fp8."""
    import difflib

    family, generation, size = model_family(word)
    near = [n for n in names
            if (f := model_family(n)) and difflib.SequenceMatcher(None, family, f[0]).ratio() >= 0.75
            and (size is None or f[2] == size) and (generation is None or f[1] in (None, generation))
            and (generation is not None or f[1] is None or size is not None)]
    base = word.rsplit("/", 1)[-1].lower()
    match = difflib.get_close_matches(base, near, n=1, cutoff=0.5)
    return match[0] if match and match[0] != word else None


def engines() -> list[str]:
    """The engines whose KV rules the planner knows (every adapter that has them)."""
    return engines_with_rules()


def engine_rules(engine: str | None) -> KVRules:
    if engine is None:
        return PLAIN
    rules = kv_rules(engine.lower()) if engine.lower() in ENGINES else None
    if rules is None:
        raise PlanError(f"no KV rules for engine {engine!r}; known: {', '.join(engines())}")
    return rules


# --- GPUs --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    name: str
    bytes: int
    capability: tuple[int, int] | None = None  # CUDA compute capability; None: not known (a size given)
    wall: bool = False  # a CPU memory wall (kvbench plan --memory), not a GPU
    cuda_bytes: int | None = None  # the total CUDA reports, where a public log showed it (gpus.toml cuda_mib)
    cuda_source: str = ""
    memory_source: str = ""  # where gpus.toml's memory_mib was read (a public nvidia-smi output or log)
    unified_memory: bool = False  # the card's memory is the host's, shared with the CPU (DGX Spark's GB10)
    #: how its GPUs talk under tensor parallel: "nvlink" (SXM boards: NCCL's many channels, NVLS, custom
    #: all-reduce) or "pcie"; "unknown" for a size given (planned as NVLink: the larger buffers)
    interconnect: str = "unknown"
    bandwidth_bytes_per_s: float | None = None  # the specification's memory bandwidth (gpus.toml bandwidth_gb_s)
    bandwidth_source: str = ""
    #: (NVML name, bytes/s, source) of a form of the card whose figure differs (None: no public figure)
    bandwidth_variants: tuple[tuple[str, float | None, str], ...] = ()

    def bandwidth(self, device_name: str = "") -> tuple[float | None, str]:
        """The specification's bandwidth (bytes/s) and where it was read, of the form NVML names ``device_name``
        where that form's figure differs (None: no public figure)."""
        for name, rate, source in self.bandwidth_variants:
            if name.lower() == device_name.strip().lower():
                return rate, f"{name}: {source}"
        return self.bandwidth_bytes_per_s, self.bandwidth_source

    def cuda_memory(self) -> tuple[float, str]:
        """What CUDA reports as the card's total (torch.cuda.mem_get_info), the figure vLLM and SGLang budget
        against: the logged figure where one is known, else NVML's total less :data:`CUDA_GAP_GIB`."""
        if self.cuda_bytes:
            return float(self.cuda_bytes), f"CUDA's total {self.cuda_bytes / GIB:.2f} GiB: {self.cuda_source}"
        cuda = self.bytes - CUDA_GAP_GIB * GIB
        return cuda, (f"CUDA's total estimated: {self.bytes / GIB:.2f} GiB less {CUDA_GAP_GIB} GiB (fitted: the gap "
                      "between NVML's and CUDA's totals on the H100 and RTX 3090 logs; no log of this card)")


_GPU_TABLE: dict[str, tuple[GPU, tuple[str, ...]]] = {}  # gpus.toml, read once: {name: (GPU, its spellings)}


def _gpu_table() -> dict[str, tuple[GPU, tuple[str, ...]]]:
    if not _GPU_TABLE:
        for name, spec in tomllib.loads(GPUS_FILE.read_text()).items():
            cc, cuda = spec.get("compute_capability"), spec.get("cuda_mib")
            card = GPU(name, spec["memory_mib"] * 2**20, tuple(int(x) for x in cc.split(".")) if cc else None,
                       cuda_bytes=cuda * 2**20 if cuda else None, cuda_source=spec.get("cuda_source", ""),
                       memory_source=spec.get("memory_source", ""),
                       unified_memory=bool(spec.get("unified_memory", False)),
                       interconnect=spec.get("interconnect", "pcie"),
                       bandwidth_bytes_per_s=spec["bandwidth_gb_s"] * 1e9 if spec.get("bandwidth_gb_s") else None,
                       bandwidth_source=spec.get("bandwidth_source", ""),
                       bandwidth_variants=tuple((name, rate * 1e9 or None, spec.get("bandwidth_variants_source", ""))
                                                for name, rate in spec.get("bandwidth_variants", {}).items()))
            _GPU_TABLE[name] = (card, (name, *spec.get("names", ())))
    return _GPU_TABLE


def gpu_specs() -> dict[str, GPU]:
    return {name: card for name, (card, _) in _gpu_table().items()}


def gpu_catalog() -> dict[str, int]:
    """{name: bytes}."""
    return {name: g.bytes for name, g in gpu_specs().items()}


# Words of a GPU's name that tell no card from another: the vendor, the brand, the memory's kind.
NAME_NOISE = {"NVIDIA", "GEFORCE", "TESLA", "QUADRO", "RTX", "AMD", "INSTINCT", "GENERATION",
              "HBM2", "HBM2E", "HBM3", "HBM3E", "GDDR6", "GDDR6X", "GDDR7"}
# Words that only narrow a model down, its form and its memory: a name may leave them out ("A100"), never a model
# word ("4070" is not "4070 Ti Super").
FORMS = {"SXM": "SXM", "SXM2": "SXM", "SXM4": "SXM", "SXM5": "SXM", "PCIE": "PCIE", "NVL": "NVL"}
SIZE_WORD = re.compile(r"(\d+)(?:GB|GIB|G)")


def name_words(name: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """(model words, qualifier words) of a GPU's name as NVML or a user writes it: "NVIDIA A100-SXM4-80GB" is
    (A100; SXM, 80GB), "RTX4090", "4090" and "NVIDIA GeForce RTX 4090" are (4090;)."""
    model, qualifiers = [], set()
    for word in re.findall(r"[A-Z0-9]+", name.upper().replace("RTX", " RTX ")):
        if size := SIZE_WORD.fullmatch(word):
            qualifiers.add(f"{size[1]}GB")
        elif word in FORMS:
            qualifiers.add(FORMS[word])
        elif word not in NAME_NOISE:
            model += re.fullmatch(r"(\d{4})([A-Z]+)", word).groups() if re.fullmatch(r"\d{4}[A-Z]+", word) else [word]
    return tuple(model), frozenset(qualifiers)


def _sized(qualifiers: frozenset[str]) -> bool:
    return any(q.endswith("GB") for q in qualifiers)


def gpus_named(name: str) -> tuple[list[str], bool]:
    """The catalog's cards ``name`` may mean, and whether it names one exactly (all its words): a name matches a
    card's spelling when their model words are the same and its qualifiers are among the spelling's."""
    model, qualifiers = name_words(name)
    exact, loose = [], []
    for key, (_, spellings) in _gpu_table().items():
        words = [name_words(s) for s in spellings]
        if any(set(m) == set(model) and q == qualifiers for m, q in words):
            exact.append(key)
        elif any(set(m) == set(model) and qualifiers <= q for m, q in words):
            loose.append(key)
    return (exact, True) if exact else (loose, False)


def gpu(name_or_size: str) -> GPU:
    """A GPU by name, as the catalog, NVML or a user writes it ("H100-80GB", "NVIDIA H100 80GB HBM3", "h100 sxm",
    "4090"), or by size ('48GiB', '24GB', '80G'). A name that fits several cards is refused with them."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(gib|gb|g)\s*", name_or_size, re.IGNORECASE)
    if m:
        value, unit = float(m[1]), m[2].lower()
        if value <= 0:
            raise PlanError(f"a GPU size must be positive, not {name_or_size!r}")
        size = int(value * (1e9 if unit == "gb" else GIB))
        # a size given is the memory the engine budgets against: what CUDA reports, no gap of a card's taken off
        return GPU(name_or_size.strip(), size, cuda_bytes=size, cuda_source="the size given")
    table = _gpu_table()
    keys, exact = gpus_named(name_or_size)
    if len(keys) > 1:
        raise PlanError(f"GPU {name_or_size!r} is {', '.join(keys[:-1])} or {keys[-1]}: name one "
                        "(or give a size such as 48GiB)")
    if not keys:
        raise PlanError(_unknown_gpu(name_or_size))
    key = keys[0]
    # "4060 Ti" of a catalog that knows only the 16 GB one: a card every spelling of which says its size is sold
    # in other sizes, which must not be planned as it
    if not exact and not _sized(name_words(name_or_size)[1]) and all(_sized(name_words(s)[1]) for s in table[key][1]):
        raise PlanError(f"GPU {name_or_size!r} is sold in more than one size: name {key}, or give its size "
                        "(such as 8GiB)")
    return table[key][0]


def _unknown_gpu(name: str) -> str:
    """One line for a name no card has, the nearest card first ("did you mean", difflib through common/suggest)."""
    from kvbench.common.suggest import closest

    def spelled(words: tuple[tuple[str, ...], frozenset[str]]) -> str:
        return " ".join([*words[0], *sorted(words[1])])

    near: dict[str, str] = {}
    for key, (_, spellings) in _gpu_table().items():
        for s in spellings:
            words = name_words(s)
            near.setdefault(spelled(words), key)
            near.setdefault(spelled((words[0], frozenset())), key)  # the model alone: "H10O" is near "H100"
    match = closest(spelled(name_words(name)), near)
    hint = f"did you mean {near[match]!r}? " if match else ""
    return f"unknown GPU {name!r}; {hint}known: {', '.join(_gpu_table())} (or a size such as 48GiB)"


def gpu_of_device(name: str, total_bytes: int) -> str:
    """The planner's name for a GPU as NVML reports it (its name, its total): the catalog's card of that name
    ("NVIDIA H100 80GB HBM3" is H100-80GB, "NVIDIA H100 PCIe" H100-PCIe, "NVIDIA GeForce RTX 4090" RTX-4090)
    whose memory is within 3 % of NVML's total, else its size ("139.810547GiB": planned without a compute
    capability or a logged CUDA total; a MIG slice is one)."""
    table = _gpu_table()
    model = set(name_words(name)[0])
    named = gpus_named(name)[0] or [  # a name with words the catalog lacks ("... MIG 1g.10gb"): its model words
        key for key, (_, spellings) in table.items()
        if any(name_words(s)[0] and set(name_words(s)[0]) <= model for s in spellings)]
    fits = [key for key in named if abs(table[key][0].bytes - total_bytes) <= 0.03 * table[key][0].bytes]
    if fits:
        return min(fits, key=lambda key: abs(table[key][0].bytes - total_bytes))
    return f"{total_bytes / GIB:.6f}GiB"


def gpu_memory(name_or_size: str) -> tuple[str, int]:
    g = gpu(name_or_size)
    return g.name, g.bytes


# --- sizes a user types ------------------------------------------------------------------------------

TOKEN_SUFFIX = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 2**20}
BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "kib": 2**10, "mb": 1e6, "mib": 2**20, "gb": 1e9, "gib": 2**30, "g": 2**30,
              "tb": 1e12, "tib": 2**40, "t": 2**40}


def parse_tokens(text: str | int | None, option: str) -> int | None:
    """Tokens as vLLM's --max-model-len reads them: 131072, 32k (32,000), 128K (131,072), 25.6k."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise PlanError(f"{option} takes a number of tokens such as 32768, 32k (32,000) or 128K (131,072), "
                        f"not {text!r}")
    value = float(m[1]) * TOKEN_SUFFIX[m[2]]
    if value != int(value) or value < 1:
        raise PlanError(f"{option} must be a whole number of tokens >= 1, not {text!r}")
    return int(value)


def parse_bytes(text: str | float | None, option: str) -> float | None:
    """A size: 61GiB, 65.5GB, 642G (GiB), 688586727753 (bytes)."""
    if text is None or isinstance(text, (int, float)):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in BYTE_UNITS:
        raise PlanError(f"{option} takes a size such as 61GiB, 65.5GB or 688586727753 (bytes), not {text!r}")
    value = float(m[1]) * BYTE_UNITS[m[2].lower()]
    if value <= 0:
        raise PlanError(f"{option} must be positive, not {text!r}")
    return value


def parse_int(text: str | int | None, option: str, minimum: int = 1) -> int | None:
    if text is None or isinstance(text, int):
        value = text
    else:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise PlanError(f"{option} takes a whole number, not {text!r}") from None
    if value is not None and value < minimum:
        raise PlanError(f"{option} must be >= {minimum}, not {value}")
    return value


def parse_float(text: str | float | None, option: str) -> float | None:
    if text is None or isinstance(text, (int, float)):
        return text
    try:
        return float(str(text).strip())
    except ValueError:
        raise PlanError(f"{option} takes a number, not {text!r}") from None
