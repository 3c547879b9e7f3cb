"""integrations/kubernetes/: every object validates against the Kubernetes API's own schemas (the
kubernetes-validate package, offline, strict: an unknown field fails), and the example holds together (the
Job's shares, its Service and subdomain, the owner's port). Its share script runs for real in
tests/run/test_merge.py."""
from __future__ import annotations

import pytest
import yaml

from tests.helpers import REPO

FILES = sorted((REPO / "integrations/kubernetes").glob("*.yaml"))
KUBERNETES = "1.33.0"  # the schemas of a Kubernetes release kubernetes-validate ships


def objects(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_object_validates_against_the_kubernetes_schemas(path):
    import kubernetes_validate

    assert objects(path)
    for obj in objects(path):
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_a_broken_object_would_be_refused():
    import kubernetes_validate

    job = next(o for o in objects(REPO / "integrations/kubernetes/kvbench-load.yaml") if o["kind"] == "Job")
    job["spec"]["completionMode"] = 4  # not a string
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES, strict=True)
    job["spec"]["completionMode"], job["spec"]["shards"] = "Indexed", 2  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES, strict=True)


def test_the_load_job_holds_together():
    docs = {o["kind"]: o for o in objects(REPO / "integrations/kubernetes/kvbench-load.yaml")}
    job, service = docs["Job"], docs["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == int(env["SHARES"])
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert env["OWNER_HOST"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(env["OWNER_PORT"]) == service["spec"]["ports"][0]["port"] == pod["containers"][0]["ports"][0]["containerPort"]
    mounts = {m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts == {v["name"] for v in pod["volumes"]}
    assert "--load-share \"$i/$SHARES\"" in docs["ConfigMap"]["data"]["share.sh"]
