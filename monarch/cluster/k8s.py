"""Kubernetes manifests for attach-mode workers: a headless Service and a StatefulSet of worker pods.

Each pod runs `python -m monarch worker --listen tcp://0.0.0.0:PORT` with the shared secret mounted from a
Kubernetes Secret; the controller attaches to the pods' stable DNS names (`worker_addresses`). `to_yaml`
writes the documents as YAML for `kubectl apply -f -` without needing a YAML library.
"""
from __future__ import annotations

import base64
import json
import re
import secrets
from typing import Any

from monarch.errors import MonarchError

DEFAULT_PORT = 26600  # the attach-mode agent's port (the agent imports it from here)
SECRET_KEY = "secret"  # the key in the Secret's data that holds the shared secret
SECRET_DIR = "/etc/monarch/attach"  # where pods mount the Secret; MONARCH_ATTACH_SECRET_FILE names the file in it
PORT_NAME = "monarch"  # the container port's name, used by the readiness probe and the Service
MAX_NAME = 52  # a StatefulSet's pods carry the label `<name>-<10 hex>`, which must fit in 63 characters

NETWORK_NOTE = """\
Attach-mode monarch workers (monarch.cluster.k8s): a headless Service and a StatefulSet whose pods run
`python -m monarch worker --listen tcp://0.0.0.0:PORT` and wait for a controller. The controller attaches with
monarch.actor.attach_to_workers(workers=[...]) over the pods' DNS names (`monarch k8s manifest --addresses`).
Network: besides the agent port (the container port named "monarch"), the pods need unrestricted TCP with each
other and with the controller: MPICH's Hydra proxies connect back to the controller's mpiexec and the workers
connect to the controller's control socket, both on ports chosen at run time. A NetworkPolicy that selects these
pods must allow all TCP ingress and egress among them and with the controller.
The shared secret is read from the file MONARCH_ATTACH_SECRET_FILE, mounted from the Secret named in the pods."""

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")  # RFC 1123 label
_SERVICE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")  # RFC 1035 label: what a Service name must be
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")  # RFC 1123


class ManifestError(MonarchError, ValueError):
    """A Kubernetes manifest was asked for with a bad argument; the message names the value and the fix."""


def manifest(name: str, replicas: int, image: str, gpus: int = 0, port: int = DEFAULT_PORT,
             namespace: str = "default", secret_name: str | None = None, *, create_secret: bool = False,
             python: str = "python") -> list[dict[str, Any]]:
    """The documents that run `replicas` attach-mode workers: [Secret,] headless Service, StatefulSet.

    The pods read the shared secret from a file mounted from the Secret `secret_name` (default
    `<name>-attach`), key "secret"; `create_secret` adds that Secret, holding a new random secret.
    `python` is the interpreter in `image` that has monarch installed.
    """
    secret_name = default_secret_name(name) if secret_name is None else secret_name
    _validate(name, replicas, image, gpus, port, namespace, secret_name, python)
    docs = [secret(secret_name, namespace, labels(name))] if create_secret else []
    return docs + [service(name, namespace, port), statefulset(name, replicas, image, gpus, port, namespace,
                                                               secret_name, python)]


def worker_addresses(name: str, replicas: int, namespace: str = "default", port: int = DEFAULT_PORT,
                     cluster_domain: str = "cluster.local") -> list[str]:
    """The pods' stable addresses, in rank order, for `attach_to_workers(workers=...)`."""
    return [f"tcp://{name}-{i}.{name}.{namespace}.svc.{cluster_domain}:{port}" for i in range(replicas)]


def default_secret_name(name: str) -> str:
    """The Secret the pods of `name` read the shared secret from, unless told another."""
    return f"{name}-attach"


def labels(name: str) -> dict[str, str]:
    """The labels of every object of the worker set `name`; the Service and StatefulSet select on them."""
    return {"app.kubernetes.io/name": "monarch-worker", "app.kubernetes.io/instance": name}


def service(name: str, namespace: str, port: int) -> dict[str, Any]:
    """The headless Service that gives each pod the DNS name `<name>-<i>.<name>.<namespace>.svc...`;
    not-ready pods are published too, so the names resolve while the agents start."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels(name),
                     "ports": [{"name": PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}]}}


def statefulset(name: str, replicas: int, image: str, gpus: int, port: int, namespace: str,
                secret_name: str, python: str = "python") -> dict[str, Any]:
    """The StatefulSet of worker pods, all started at once (Parallel), named by the Service `name`."""
    pod = {"containers": [container(image, gpus, port, python)],
           "volumes": [{"name": "attach-secret", "secret": {"secretName": secret_name}},
                       {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
            "spec": {"serviceName": name, "replicas": replicas, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": labels(name)},
                     "template": {"metadata": {"labels": labels(name)}, "spec": pod}}}


def container(image: str, gpus: int, port: int, python: str = "python") -> dict[str, Any]:
    """The worker container: the attach-mode agent on `port`, ready once the port accepts connections.

    /dev/shm is a memory-backed volume (a container's default 64 MiB is too small for shared-memory transports).
    """
    spec: dict[str, Any] = {
        "name": "worker", "image": image,
        "command": [python, "-m", "monarch", "worker", "--listen", f"tcp://0.0.0.0:{port}"],
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": [{"name": "MONARCH_ATTACH_SECRET_FILE", "value": f"{SECRET_DIR}/{SECRET_KEY}"}],
        "volumeMounts": [{"name": "attach-secret", "mountPath": SECRET_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        "readinessProbe": {"tcpSocket": {"port": PORT_NAME}, "periodSeconds": 5},
    }
    if gpus:
        spec["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    return spec


def secret(secret_name: str, namespace: str, object_labels: dict[str, str], value: str | None = None
           ) -> dict[str, Any]:
    """A Secret holding the shared secret (`value`, default: 32 random bytes as hex) under the key "secret"."""
    value = secrets.token_hex(32) if value is None else value
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name, "namespace": namespace, "labels": object_labels},
            "data": {SECRET_KEY: base64.b64encode(value.encode()).decode()}}


def _validate(name: str, replicas: int, image: str, gpus: int, port: int, namespace: str, secret_name: str,
              python: str) -> None:
    if not isinstance(name, str) or len(name) > MAX_NAME or not _SERVICE.match(name):
        _bad(f"name {name!r}", f"use 1-{MAX_NAME} lowercase letters, digits and '-', starting with a letter and "
             "ending with a letter or digit, e.g. 'monarch-workers' (it names the Service, the StatefulSet "
             "and, with an index, each pod)")
    _count("replicas", replicas, 1, 1 << 16, "the number of worker pods")
    _count("gpus", gpus, 0, 1 << 10, "GPUs per pod (0: none requested)")
    _count("port", port, 1, 65535, f"the agent's TCP port (default {DEFAULT_PORT})")
    if not isinstance(namespace, str) or len(namespace) > 63 or not _LABEL.match(namespace):
        _bad(f"namespace {namespace!r}", "use 1-63 lowercase letters, digits and '-', starting and ending with a "
             "letter or digit (the namespace must already exist)")
    if not isinstance(secret_name, str) or len(secret_name) > 253 or not _SUBDOMAIN.match(secret_name):
        _bad(f"secret name {secret_name!r}", "use lowercase letters, digits, '-' and '.', at most 253, "
             "starting and ending with a letter or digit")
    for what, value in (("image", image), ("python", python)):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            _bad(f"{what} {value!r}", f"pass the container {what} as one word without spaces, e.g. "
                 + ("'ghcr.io/me/trainer:1.0'" if what == "image" else "'python3'"))


def _count(what: str, value: int, low: int, high: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _bad(f"{what}={value!r}", f"{what} is {meaning}: pass a whole number from {low} to {high}")


def _bad(what: str, fix: str) -> None:
    raise ManifestError(f"Kubernetes manifest: {what} is not valid: {fix}")


_PLAIN = re.compile(r"[A-Za-z/][A-Za-z0-9_./-]*\Z")  # a string that YAML reads back as itself without quotes
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}  # YAML 1.1 reads these as bools/null


def to_yaml(docs: list[dict[str, Any]], comment: str = NETWORK_NOTE) -> str:
    """`docs` as one YAML stream (`---` before each document), `comment` as `#` lines at its top.

    Strings that could read back as something else are written as JSON strings (valid YAML).
    """
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    for doc in docs:
        lines += ["---", *_block(doc, "")]
    return "\n".join(lines) + "\n"


def _block(value: dict[str, Any] | list[Any], indent: str) -> list[str]:
    """The lines of a non-empty mapping or sequence at `indent`."""
    out = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                out += [f"{indent}{_scalar(key)}:", *_block(item, indent + "  ")]
            else:
                out.append(f"{indent}{_scalar(key)}: {_scalar(item)}")
        return out
    for item in value:
        if isinstance(item, (dict, list)) and item:
            first, *rest = _block(item, indent + "  ")
            out += [f"{indent}- {first.lstrip()}", *rest]
        else:
            out.append(f"{indent}- {_scalar(item)}")
    return out


def _scalar(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, dict, list)):
        return json.dumps(value)  # null, true/false, numbers, {} and [] read the same in YAML
    assert isinstance(value, str), f"no YAML form for {type(value).__name__} {value!r}"
    return value if _PLAIN.match(value) and value.lower() not in _RESERVED else json.dumps(value)
