"""`monarch k8s manifest` and monarch.cluster.k8s: every document, made by the function and by the real CLI,
passes kubernetes-validate's strict schemas (unknown fields fail) of Kubernetes 1.30 and of the newest it ships,
the documents fit each other (names, selectors, ports, the Secret), and bad arguments fail with ManifestError.
"""
from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from monarch.cluster import k8s
from monarch.errors import MonarchError

try:
    import kubernetes_validate.utils as kv
    import yaml  # PyYAML comes with kubernetes-validate
except ImportError:
    kv = yaml = None

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(kv is None, reason="kubernetes-validate is not installed "
                                                      "(pip install -e '.[cluster]'): manifests not validated")]

ROOT = Path(__file__).resolve().parents[2]
T = 60
VERSIONS = ("1.30.0", kv.latest_version()) if kv else ()
CASES = [
    dict(name="w", replicas=1, image="trainer:1"),
    dict(name="monarch-workers", replicas=4, image="ghcr.io/acme/trainer:2.1", gpus=2, namespace="ml-team"),
    dict(name="mw", replicas=4, image="registry.local:5000/t@sha256:" + "ab" * 32, gpus=0, port=31000,
         namespace="research", secret_name="team.attach", create_secret=True, python="python3"),
    dict(name="g8", replicas=1, image="trainer", gpus=8, create_secret=True),
]


def cli_args(case: dict[str, Any]) -> list[str]:
    args = []
    for key, value in case.items():
        flag = "--" + key.replace("_", "-")
        args.append(flag if value is True else f"{flag}={value}")
    return args


def monarch_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monarch", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=T)


def validate(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        for version in VERSIONS:
            kv.validate(doc, version, strict=True)


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = {doc["kind"]: doc for doc in docs}
    assert len(kinds) == len(docs), [doc["kind"] for doc in docs]
    return kinds


def check_fit(docs: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """What a schema cannot see: the documents name and select each other, and carry the arguments."""
    kinds = by_kind(docs)
    svc, sts = kinds["Service"], kinds["StatefulSet"]
    namespace, port = case.get("namespace", "default"), case.get("port", k8s.DEFAULT_PORT)
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == pod_labels == sts["spec"]["selector"]["matchLabels"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] == sts["metadata"]["name"] == case["name"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel" and sts["spec"]["replicas"] == case["replicas"]
    assert {d["metadata"]["namespace"] for d in docs} == {namespace}
    pod = sts["spec"]["template"]["spec"]
    (box,) = pod["containers"]
    assert box["image"] == case["image"]
    assert box["command"] == [case.get("python", "python"), "-m", "monarch", "worker", "--listen",
                              f"tcp://0.0.0.0:{port}"]
    assert box["ports"] == [{"name": k8s.PORT_NAME, "containerPort": port, "protocol": "TCP"}]
    assert svc["spec"]["ports"][0]["targetPort"] == port
    assert box["readinessProbe"]["tcpSocket"]["port"] == k8s.PORT_NAME
    gpus = case.get("gpus", 0)
    assert box.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0) == gpus
    check_secret(kinds, pod, box, case)


def check_secret(kinds: dict[str, dict[str, Any]], pod: dict[str, Any], box: dict[str, Any],
                 case: dict[str, Any]) -> None:
    """The pods read the file MONARCH_ATTACH_SECRET_FILE from the Secret's key, mounted where it points."""
    secret_name = case.get("secret_name", f"{case['name']}-attach")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in box["volumeMounts"]}
    (volume,) = [v for v in volumes.values() if "secret" in v]
    assert volume["secret"]["secretName"] == secret_name
    env = {e["name"]: e["value"] for e in box["env"]}
    assert env["MONARCH_ATTACH_SECRET_FILE"] == f"{mounts[volume['name']]}/{k8s.SECRET_KEY}"
    assert "MONARCH_ATTACH_SECRET" not in env
    assert ("Secret" in kinds) == bool(case.get("create_secret"))
    if "Secret" in kinds:
        secret = kinds["Secret"]
        assert secret["metadata"]["name"] == secret_name and list(secret["data"]) == [k8s.SECRET_KEY]
        assert len(base64.b64decode(secret["data"][k8s.SECRET_KEY], validate=True)) == 64


@pytest.mark.parametrize("case", CASES)
def test_function_documents_pass_strict_schemas_and_fit(case: dict[str, Any]) -> None:
    docs = k8s.manifest(**case)
    validate(docs)
    check_fit(docs, case)
    assert list(yaml.safe_load_all(k8s.to_yaml(docs))) == docs


@pytest.mark.parametrize("case", CASES)
def test_cli_yaml_passes_strict_schemas_and_matches_the_function(case: dict[str, Any]) -> None:
    done = monarch_cli("k8s", "manifest", *cli_args(case))
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    validate(docs)
    check_fit(docs, case)
    secretless = [d for d in k8s.manifest(**case) if d["kind"] != "Secret"]
    assert [d for d in docs if d["kind"] != "Secret"] == secretless
    replicas, namespace = case["replicas"], case.get("namespace", "default")
    addresses = k8s.worker_addresses(case["name"], replicas, namespace, case.get("port", k8s.DEFAULT_PORT))
    assert repr(addresses) in done.stderr
    only = monarch_cli("k8s", "manifest", *cli_args(case), "--addresses")
    assert only.returncode == 0 and only.stdout.split() == addresses, only.stderr


def test_the_kubernetes_validate_cli_accepts_the_whole_stream(tmp_path: Path) -> None:
    """The printed stream as kubectl reads it: leading comments, `---` separated documents, quoted strings."""
    out = tmp_path / "workers.yaml"
    out.write_text(monarch_cli("k8s", "manifest", *cli_args(CASES[2])).stdout)
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", VERSIONS[0], str(out)],
                          capture_output=True, text=True, timeout=T)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed") == 3, done.stdout


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The schemas used above can fail: a misspelt field in the pod spec is caught."""
    docs = k8s.manifest("w", 1, "trainer")
    sts = by_kind(docs)["StatefulSet"]
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kv.ValidationError, match="readinessProbes"):
        kv.validate(sts, VERSIONS[0], strict=True)


def test_worker_addresses_are_the_pods_dns_names() -> None:
    assert k8s.worker_addresses("mw", 2, "ml", 7000) == [
        "tcp://mw-0.mw.ml.svc.cluster.local:7000", "tcp://mw-1.mw.ml.svc.cluster.local:7000"]
    assert k8s.worker_addresses("w", 1) == [f"tcp://w-0.w.default.svc.cluster.local:{k8s.DEFAULT_PORT}"]


def test_yaml_quotes_strings_that_would_read_back_as_something_else() -> None:
    tricky = ["yes", "No", "on", "null", "~", "", "123", "1e3", "0x1F", "a: b", "- x", "#c", "*ref", "{x}",
              "two\nlines", 'q"uote', "tab\t", "ünï", "/dev/shm", "nvidia.com/gpu"]
    doc = {"kind": "T", "data": {s: s for s in tricky}, "list": tricky, "nested": [[1, {"a": []}], {}],
           "n": None, "b": False}
    assert list(yaml.safe_load_all(k8s.to_yaml([doc, doc], comment="a\nb"))) == [doc, doc]


BAD = [
    (dict(name="9lives"), "'9lives'"),
    (dict(name="Workers"), "'Workers'"),
    (dict(name="w_1"), "'w_1'"),
    (dict(name="x" * 53), "x" * 53),
    (dict(replicas=0), "replicas=0"),
    (dict(gpus=-1), "gpus=-1"),
    (dict(port=70000), "port=70000"),
    (dict(namespace="ML"), "'ML'"),
    (dict(secret_name="-bad"), "'-bad'"),
    (dict(image=""), "image ''"),
    (dict(image="my image"), "'my image'"),
]


@pytest.mark.parametrize(("change", "named"), BAD)
def test_bad_arguments_fail_naming_the_value_and_the_fix(change: dict[str, Any], named: str) -> None:
    args = dict(name="w", replicas=2, image="trainer") | change
    with pytest.raises(k8s.ManifestError, match="is not valid: .*(use|pass)") as info:
        k8s.manifest(**args)
    assert isinstance(info.value, MonarchError) and named in str(info.value)
    done = monarch_cli("k8s", "manifest", *cli_args(args))
    assert done.returncode == 2 and done.stdout == "" and named in done.stderr, done.stderr


def test_replicas_must_be_a_whole_number() -> None:
    with pytest.raises(k8s.ManifestError, match="replicas=True"):
        k8s.manifest("w", True, "trainer")  # type: ignore[arg-type]
