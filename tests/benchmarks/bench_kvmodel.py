"""The KV model over the catalog (bench/planner/catalog): every model's config read into its geometry, and every
engine's KV rules answering for it, as ``kvbench plan`` and the planner's searches ask."""
import pytest

from kvbench.kv.model_config import parse_hf_dict, read_json
from kvbench.kv.rules import KVQuestion
from kvbench.planner import CATALOG_DIR, catalog_names, engine_rules, engines


@pytest.fixture(scope="module")
def raws():
    return [(name, read_json(CATALOG_DIR / f"{name}.json")) for name in catalog_names()]


def test_parse_catalog_configs(benchmark, raws):
    geometries = benchmark(lambda: [parse_hf_dict(raw, name)[2] for name, raw in raws])
    assert len(geometries) == len(raws) >= 10


def test_engine_rules_over_catalog(benchmark, raws):
    geometries = [parse_hf_dict(raw, name)[2] for name, raw in raws]
    rules = [engine_rules(e) for e in engines()]

    def answer_all():
        answers = 0
        for geom in geometries:
            for r in rules:
                for context in (4096, 32_768):
                    try:
                        r.answer(KVQuestion(geom, "auto", context, 8))
                    except ValueError:  # a model an engine cannot hold (e.g. a dtype it lacks): a refusal
                        continue
                    answers += 1
        return answers

    answers = benchmark(answer_all)
    assert answers >= len(geometries) * len(rules)  # most pairs answer
