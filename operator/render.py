"""InferenceService spec → the desired child objects. Pure functions: no API calls, no clock.

Children (all owned by the InferenceService, so deleting it garbage-collects them):
- PVC `<name>-weights` for hf:// models, filled once by the `model-download` init container;
- Deployment `<name>` running `pagoda serve` (replicas from spec.replicas, never from the template),
  or a LeaderWorkerSet `<name>` of multi-node groups (leaderworkerset.py) when spec.parallelism asks;
- Service `<name>` (port 8000 `http`);
- ServiceMonitor `<name>` when wanted and its CRD is installed;
- InferencePool `<name>` when spec.routing.inferencePool asks and its CRD is installed (routing.py);
- PodDisruptionBudget `<name>` when spec.replicas > 1.
Every child's shape lives here, one function each, so the goldens review them together; where the
weights come from (the model uri) is `weights.py`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from pagoda.operator import crd, routing
from pagoda.operator import leaderworkerset as lws
from pagoda.operator.weights import (
    MODELS_DIR,
    WeightsSource,
    served_name,
    weights_claim,
    weights_source,
)

FIELD_MANAGER = "pagoda-operator"
SERVER_PORT = 8000
TEMPLATE_HASH_ANNOTATION = f"{crd.GROUP}/pod-template-hash"
OWNER_LABEL = f"{crd.GROUP}/inferenceservice"
SERVER_CONTAINER = "server"
DOWNLOAD_CONTAINER = "model-download"
UID = 1000  # the serving image's non-root user


@dataclass(frozen=True)
class Owner:
    """The InferenceService that owns the children (for names, namespace and ownerReferences)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: dict[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def selector_labels(owner: Owner) -> dict[str, str]:
    return {OWNER_LABEL: owner.name, "app.kubernetes.io/component": "inference"}


def selector_string(owner: Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(owner).items()))


def common_labels(owner: Owner) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pagoda-server", "app.kubernetes.io/instance": owner.name,
            "app.kubernetes.io/managed-by": FIELD_MANAGER, "app.kubernetes.io/part-of": "pagoda",
            **selector_labels(owner)}


def endpoint(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{SERVER_PORT}/v1"


def _metadata(owner: Owner, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": labels or common_labels(owner),
            "ownerReferences": [{"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": owner.name,
                                 "uid": owner.uid, "controller": True, "blockOwnerDeletion": True}]}


# --- the PVC and its download ------------------------------------------------------------------------


def weights_pvc(owner: Owner, spec: dict[str, Any]) -> dict[str, Any]:
    storage = spec["storage"]
    pvc_spec: dict[str, Any] = {"accessModes": list(storage["accessModes"]),
                                "resources": {"requests": {"storage": storage["size"]}}}
    if storage.get("storageClassName"):
        pvc_spec["storageClassName"] = storage["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _metadata(owner, weights_claim(owner.name)), "spec": pvc_spec}


# Runs in the serving image: server/model_download.py (marker checked first and written last, a
# failure's cause as the termination message, which status.py carries into the Degraded condition).
DOWNLOAD_COMMAND = ["python", "-m", "pagoda.server.model_download"]


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def download_container(spec: dict[str, Any], source: WeightsSource, image: str) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "PAGODA_MODEL", "value": source.model_path},
        {"name": "HF_REPO_ID", "value": source.repo_id},
        {"name": "HF_REVISION", "value": source.revision},
        {"name": "HF_HOME", "value": f"{MODELS_DIR}/.hf-home"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
    ]
    secret = spec["model"].get("hfTokenSecretRef")
    if secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["name"], "key": secret.get("key", "token")}}})
    container: dict[str, Any] = {
        "name": DOWNLOAD_CONTAINER, "image": image, "command": list(DOWNLOAD_COMMAND), "env": env,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


# --- the server Deployment ---------------------------------------------------------------------------


def engine_env(spec: dict[str, Any], source: WeightsSource) -> list[dict[str, str]]:
    """`pagoda serve` flags as PAGODA_* variables (booleans as "true"/"false"): the only way we configure it."""
    engine = spec["engine"]
    values: dict[str, Any] = {
        "PAGODA_HOST": "0.0.0.0",  # the kubelet's probes and the Service reach the pod IP
        "PAGODA_PORT": SERVER_PORT,
        "PAGODA_MODEL": source.model_path,
        "PAGODA_SERVED_MODEL_NAME": served_name(spec),
        "PAGODA_DTYPE": engine["dtype"],
        "PAGODA_QUANTIZATION": engine["quantization"],
        "PAGODA_BLOCK_SIZE": engine["blockSize"],
        "PAGODA_MAX_NUM_SEQS": engine["maxNumSeqs"],
        "PAGODA_MAX_MODEL_LEN": engine.get("maxModelLen"),
        "PAGODA_MAX_NUM_BATCHED_TOKENS": engine.get("maxNumBatchedTokens"),
        "PAGODA_GPU_MEMORY_UTILIZATION": engine["gpuMemoryUtilization"],
        "PAGODA_ENABLE_PREFIX_CACHING": engine["enablePrefixCaching"],
        "PAGODA_ENABLE_CHUNKED_PREFILL": engine["enableChunkedPrefill"],
        "PAGODA_SEED": engine.get("seed"),
        "PAGODA_DRAIN_TIMEOUT": spec["drainTimeoutSeconds"],
        "PAGODA_VLLM_COMPATIBLE_METRICS": True if routing.vllm_metrics_wanted(spec) else None,
        **lws.parallel_env(spec),
    }
    return [{"name": k, "value": _env_value(v)} for k, v in values.items() if v is not None]


def _env_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# Writable places for a read-only root filesystem: caches of HF, Triton and Python go to /tmp.
RUNTIME_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "HF_HOME", "value": "/tmp/hf-home"},
    {"name": "HF_HUB_OFFLINE", "value": "1"},  # the weights are local; serving never calls the hub
    {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
]


def server_env(spec: dict[str, Any], source: WeightsSource) -> list[dict[str, Any]]:
    """Ours first, then spec.env; a spec.env entry with the same name replaces ours in place."""
    user = {item["name"]: item for item in spec.get("env", [])}
    ours = [user.pop(item["name"], item) for item in [*engine_env(spec, source), *RUNTIME_ENV]]
    return [*ours, *user.values()]


def server_resources(spec: dict[str, Any]) -> dict[str, Any]:
    res = spec["resources"]
    requests: dict[str, Any] = {"cpu": res["cpu"], "memory": res["memory"]}
    limits: dict[str, Any] = {"memory": res["memory"]}
    if res["gpus"] > 0:
        requests[res["gpuResourceName"]] = limits[res["gpuResourceName"]] = str(res["gpus"])
    return {"requests": requests, "limits": limits}


def _health() -> dict[str, Any]:
    return {"path": "/health", "port": "http"}


def server_container(spec: dict[str, Any], source: WeightsSource, image: str) -> dict[str, Any]:
    startup_periods = math.ceil(spec["startupTimeoutSeconds"] / 10)
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if source.claim:
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": SERVER_CONTAINER, "image": image,
        "command": ["pagoda", "serve"],
        "env": server_env(spec, source),
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "startupProbe": {"httpGet": _health(), "periodSeconds": 10, "timeoutSeconds": 5,
                         "failureThreshold": startup_periods},
        "livenessProbe": {"httpGet": _health(), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5,
                           "timeoutSeconds": 3, "failureThreshold": 3},
        "resources": server_resources(spec),
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    if spec["engine"].get("extraArgs"):
        container["args"] = list(spec["engine"]["extraArgs"])
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def pod_template(owner: Owner, spec: dict[str, Any], image: str) -> dict[str, Any]:
    source = weights_source(spec["model"], owner.name)
    resources = spec["resources"]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": lws.shm_size(spec)}},
    ]
    if source.claim:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": source.claim}})
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the server never calls the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec["drainTimeoutSeconds"] + 10,
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [server_container(spec, source, image)],
        "volumes": volumes,
    }
    if source.downloads:
        pod["initContainers"] = [download_container(spec, source, image)]
    for key in ("nodeSelector", "tolerations", "affinity"):
        if resources.get(key):
            pod[key] = resources[key]
    if spec.get("imagePullSecrets"):
        pod["imagePullSecrets"] = spec["imagePullSecrets"]
    return {"metadata": {"labels": {**common_labels(owner), **routing.pod_labels(spec)}}, "spec": pod}


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def hashed_pod_template(owner: Owner, spec: dict[str, Any], image: str) -> dict[str, Any]:
    template = pod_template(owner, spec, image)
    # The hash covers only the pod template: replicas and autoscaling live outside it, so scaling
    # never restarts pods, while any change that reaches the pods shows here and rolls them.
    template["metadata"]["annotations"] = {TEMPLATE_HASH_ANNOTATION: template_hash(template)}
    return template


def leader_worker_set(owner: Owner, spec: dict[str, Any], image: str) -> dict[str, Any]:
    return lws.leader_worker_set(_metadata(owner, owner.name), spec, hashed_pod_template(owner, spec, image),
                                 "app.kubernetes.io/component")


def deployment(owner: Owner, spec: dict[str, Any], image: str) -> dict[str, Any]:
    template = hashed_pod_template(owner, spec, image)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(owner, owner.name),
        "spec": {
            "replicas": spec["replicas"],
            "selector": {"matchLabels": selector_labels(owner)},
            # One extra pod at a time, never one fewer serving: a rollout needs one spare GPU slot.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": spec["startupTimeoutSeconds"] + 600,
            "revisionHistoryLimit": 3,
            "template": template,
        },
    }


# --- Service, ServiceMonitor, PDB --------------------------------------------------------------------


def service(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner, owner.name),
            "spec": {"type": "ClusterIP", "selector": selector_labels(owner),
                     "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def service_monitor(owner: Owner, spec: dict[str, Any]) -> dict[str, Any]:
    monitoring = spec["monitoring"]
    labels = {**common_labels(owner), **monitoring.get("labels", {})}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _metadata(owner, owner.name, labels),
            "spec": {"selector": {"matchLabels": selector_labels(owner)},
                     "endpoints": [{"port": "http", "path": "/metrics", "interval": monitoring["interval"]}]}}


def pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _metadata(owner, owner.name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner)}}}


# --- everything --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildKind:
    api_version: str
    kind: str
    plural: str


PVC = ChildKind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
DEPLOYMENT = ChildKind("apps/v1", "Deployment", "deployments")
SERVICE = ChildKind("v1", "Service", "services")
SERVICE_MONITOR = ChildKind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors")
PDB = ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
INFERENCE_POOL = ChildKind(routing.POOL_API_VERSION, routing.POOL_KIND, routing.POOL_PLURAL)
LEADER_WORKER_SET = ChildKind(lws.API_VERSION, lws.KIND, lws.PLURAL)
KINDS = {k.kind: k for k in (PVC, DEPLOYMENT, SERVICE, SERVICE_MONITOR, PDB, INFERENCE_POOL, LEADER_WORKER_SET)}


@dataclass(frozen=True)
class Desired:
    """What should exist (`objects`) and what must not (`absent`: kind, name) for one InferenceService."""

    objects: list[dict[str, Any]]
    absent: list[tuple[ChildKind, str]]


def service_monitor_wanted(spec: dict[str, Any]) -> bool:
    return bool(spec["monitoring"]["serviceMonitor"])


def render(owner: Owner, spec: dict[str, Any], *, default_image: str,
           service_monitors_served: bool, inference_pools_served: bool = False,
           leader_worker_sets_served: bool = False) -> Desired:
    """All children for a spec the caller has defaulted once (`crd.with_defaults`)."""
    image = spec.get("image") or default_image
    source = weights_source(spec["model"], owner.name)
    objects: list[dict[str, Any]] = []
    absent: list[tuple[ChildKind, str]] = []
    if source.downloads:
        objects.append(weights_pvc(owner, spec))
    if not lws.wanted(spec):
        objects.append(deployment(owner, spec, image))
        if leader_worker_sets_served:
            absent.append((LEADER_WORKER_SET, owner.name))
    else:  # without the LWS CRD nothing can run the group: a status condition says so
        if leader_worker_sets_served:
            objects.append(leader_worker_set(owner, spec, image))
        absent.append((DEPLOYMENT, owner.name))
    objects.append(service(owner))
    if service_monitor_wanted(spec) and service_monitors_served:
        objects.append(service_monitor(owner, spec))
    elif service_monitors_served:
        absent.append((SERVICE_MONITOR, owner.name))
    if routing.pool_wanted(spec) and inference_pools_served:
        objects.append(routing.inference_pool(_metadata(owner, owner.name), selector_labels(owner), SERVER_PORT,
                                              spec))
    elif inference_pools_served:
        absent.append((INFERENCE_POOL, owner.name))
    if spec["replicas"] > 1:
        objects.append(pod_disruption_budget(owner))
    else:
        absent.append((PDB, owner.name))
    return Desired(objects, absent)
