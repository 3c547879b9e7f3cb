"""The GPUs the planner knows (bench/planner/gpus.toml): every card's figures and their sources, the names NVML and
users give a card, and the refusals of a name that is no card or several."""
from __future__ import annotations

import re
import tomllib

import pytest

from kvbench.planner import GPUS_FILE, PlanError, gpu, gpu_of_device, gpu_specs

MIB = 2**20
CARDS = tomllib.loads(GPUS_FILE.read_text())


@pytest.mark.parametrize("name", list(CARDS))
def test_every_card_says_its_memory_capability_and_where_they_were_read(name):
    spec = CARDS[name]
    assert isinstance(spec["memory_mib"], int) and spec["memory_mib"] > 1024
    assert re.fullmatch(r"\d+\.\d", spec["compute_capability"])
    assert re.search(r"\d{4,}", spec["memory_source"]) and re.search(r"#\d+|/|\.md|\.py|\.txt", spec["memory_source"])
    # CUDA's total, where known, is read from a log and is no more than NVML's
    assert ("cuda_mib" in spec) == ("cuda_source" in spec)
    assert spec.get("cuda_mib", 0) <= spec["memory_mib"]
    card = gpu_specs()[name]
    assert card.bytes == spec["memory_mib"] * MIB and card.memory_source == spec["memory_source"]


@pytest.mark.parametrize("name, card", [
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("H100 SXM", "H100-80GB"), ("H100-80G", "H100-80GB"),
    ("h100 80gb", "H100-80GB"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("H100 NVL", "H100-NVL"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("4090", "RTX-4090"), ("RTX4090", "RTX-4090"), ("rtx-4090", "RTX-4090"),
    ("A100 80GB PCIe", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("A100-80G", "A100-80GB"),
    ("L40S", "L40S"), ("NVIDIA L40S", "L40S"), ("NVIDIA A10", "A10"), ("A10G", "A10G"), ("NVIDIA H20", "H20"),
    ("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"), ("Tesla T4", "T4"), ("Tesla V100-SXM2-16GB", "V100-16GB"),
    ("NVIDIA A800-SXM4-80GB", "A800-80GB"), ("NVIDIA RTX A6000", "A6000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-Ada"), ("RTX 6000 Ada", "RTX-6000-Ada"),
    ("NVIDIA GeForce RTX 3090", "RTX-3090"), ("3090 Ti", "RTX-3090-Ti"), ("RTX 3060 12GB", "RTX-3060-12GB"),
    ("RTX 4060 Ti 16GB", "RTX-4060-Ti-16GB"), ("NVIDIA GB10", "DGX-Spark"), ("dgx spark", "DGX-Spark"),
    ("AMD Instinct MI300X", "MI300X"), ("NVIDIA GeForce RTX 5090", "RTX-5090"),
])
def test_names_as_nvml_and_users_write_them_are_the_card(name, card):
    assert gpu(name).name == card


@pytest.mark.parametrize("name, candidates", [
    ("A100", "A100-40GB or A100-80GB"), ("h100", "H100-80GB, H100-PCIe or H100-NVL"),
    ("V100", "V100-16GB or V100-32GB"),
])
def test_a_name_of_several_cards_is_refused_with_them(name, candidates):
    with pytest.raises(PlanError, match=re.escape(f"GPU {name!r} is {candidates}: name one")) as e:
        gpu(name)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["4060 Ti", "NVIDIA GeForce RTX 3060"])
def test_a_card_sold_in_several_sizes_needs_its_size(name):
    """The catalog knows one size of these; a name without it may be another (an 8 GB card), never planned as it."""
    with pytest.raises(PlanError, match="sold in more than one size"):
        gpu(name)


@pytest.mark.parametrize("typo, meant", [("H10O", "H100-80GB"), ("RTX 4900", "RTX-4090"), ("A100-80BG", "A100-80GB"),
                                         ("L40X", "L40S")])
def test_a_typo_is_refused_with_the_card_it_is_near(typo, meant):
    with pytest.raises(PlanError) as e:
        gpu(typo)
    message = str(e.value)
    assert message.startswith(f"unknown GPU {typo!r}; did you mean {meant!r}? known: ") and "\n" not in message


def test_a_name_near_no_card_is_refused_with_the_catalog():
    with pytest.raises(PlanError, match=r"^unknown GPU 'TPU v5e'; known: A100-40GB, .* \(or a size such as 48GiB\)$"):
        gpu("TPU v5e")


@pytest.mark.parametrize("size, expected", [("96GiB", 96 * 2**30), ("24GB", 24 * 10**9), ("80G", 80 * 2**30),
                                            ("48 gib", 48 * 2**30)])
def test_a_size_is_a_gpu_of_that_memory(size, expected):
    g = gpu(size)
    assert g.bytes == expected and g.capability is None and not g.unified_memory


def test_unified_memory_is_flagged_on_the_card():
    assert gpu("DGX-Spark").unified_memory
    assert [name for name, card in gpu_specs().items() if card.unified_memory] == ["DGX-Spark"]


@pytest.mark.parametrize("nvml, mib, card", [
    ("NVIDIA H100 PCIe", 81559, "H100-PCIe"), ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
    ("NVIDIA H100 NVL", 95830, "H100-NVL"), ("NVIDIA H20", 97871, "H20"), ("NVIDIA B200", 183359, "B200"),
    ("NVIDIA GeForce RTX 5090", 32607, "RTX-5090"), ("NVIDIA GeForce RTX 4060 Ti", 16380, "RTX-4060-Ti-16GB"),
    ("NVIDIA GeForce RTX 3060", 12288, "RTX-3060-12GB"), ("NVIDIA A800 80GB PCIe", 81920, "A800-80GB"),
    ("NVIDIA RTX A6000", 49140, "A6000"), ("Tesla V100-SXM2-16GB", 16160, "V100-16GB"),
])
def test_the_card_nvml_reports_is_the_catalogs(nvml, mib, card):
    assert gpu_of_device(nvml, mib * MIB) == card


@pytest.mark.parametrize("nvml, mib", [
    ("NVIDIA GeForce RTX 4060 Ti", 8 * 1024),  # an 8 GiB card: not the catalog's 16 GB one
    ("NVIDIA H100 80GB HBM3", 40 * 1024),  # a MIG slice: not the whole card
    ("NVIDIA GeForce RTX 5070", 12227),  # a card the catalog does not list (nvidia-smi of shkhln/libc6-shim#14)
])
def test_a_device_the_catalog_does_not_hold_is_its_size(nvml, mib):
    assert gpu_of_device(nvml, mib * MIB) == f"{mib / 1024:.6f}GiB"
