"""The InferenceService CRD: the one schema in code, and its defaulting.

`crds/inferenceservices.yaml` and `charts/pagoda/crds/inferenceservices.yaml` are generated from this module
(`python -m pagoda.operator.crd_generate --write`); a test fails when they are stale. The operator applies
the same `default`s to what it reads (`with_defaults`), so a spec means the same thing whether or not the
API server has defaulted it; the autoscaler's policy and the dashboards read their defaults from here too.
"""

from __future__ import annotations

import copy
from typing import Any

# The engine settings default to what `pagoda serve` itself defaults to (EngineArgs, the one definition).
from pagoda.server.engine.config import DEFAULTS as ENGINE_DEFAULTS
from pagoda.server.engine.config import QUANTIZATIONS

GROUP = "serving.pagoda.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["pisvc"]  # never "isvc": KServe's
API_VERSION = f"{GROUP}/{VERSION}"

# hf://org/name[@revision], pvc://claim/path/in/claim, file:///absolute/path
HF_URI = r"hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?"
PVC_URI = r"pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/\s]+)*/?"
FILE_URI = r"file:///[^\s]*"
MODEL_URI_PATTERN = f"^({HF_URI}|{PVC_URI}|{FILE_URI})$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
DURATION_PATTERN = r"^[0-9]+(ms|s|m|h)$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
RESOURCE_NAME_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$"


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _int(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "format": "int32", "description": description, **extra}


def _num(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "number", "description": description, **extra}


def _bool(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "boolean", "description": description, **extra}


def _obj(description: str, properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "description": description, "properties": properties, **extra}


def _free_object(description: str) -> dict[str, Any]:
    """A Kubernetes object passed through as-is (affinity, a toleration): validated by the Pod API."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def _string_map(description: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


MODEL = _obj("The model to serve (`{}`: the serving image's embedded SmolLM2-135M-Instruct).", {
    "uri": _str("Where the weights are: hf://org/name[@revision] (downloaded once into the weight "
                "cache PVC), pvc://claim/path (an existing claim, mounted read-only) or file:///path "
                "(baked into the image). Absent: the model embedded in the serving image "
                "(SmolLM2-135M-Instruct, GGUF; nothing to download or mount).",
                pattern=MODEL_URI_PATTERN, maxLength=512),
    "servedName": _str("The model name clients send (OpenAI `model`). Default: the last part of the uri.",
                       pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$", maxLength=128),
    "hfTokenSecretRef": _obj("A Secret key holding a Hugging Face token (gated models); hf:// only. "
                             "Never copied into status, logs or events.", {
                                 "name": _str("Secret name (same namespace).", pattern=DNS_LABEL_PATTERN,
                                              maxLength=253),
                                 "key": _str("Key in the Secret.", default="token", maxLength=253),
                             }, required=["name"]),
}, **{"x-kubernetes-validations": [
    {"rule": "!has(self.hfTokenSecretRef) || (has(self.uri) && self.uri.startsWith('hf://'))",
     "message": "hfTokenSecretRef is only used with hf:// model uris"},
]})

STORAGE = _obj("The weight cache PVC made for hf:// models (kept across restarts and rollouts).", default={}, properties={
    "size": _str("Requested size.", default="20Gi", pattern=QUANTITY_PATTERN),
    "storageClassName": _str("StorageClass; empty: the cluster default.", maxLength=253),
    "accessModes": {"type": "array", "description": "Access modes. ReadWriteMany lets replicas on "
                    "different nodes share one cache.", "default": ["ReadWriteOnce"], "minItems": 1,
                    "items": {"type": "string",
                              "enum": ["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany", "ReadWriteOncePod"]}},
})

RESOURCES = _obj("Compute resources and placement of each serving pod.", default={}, properties={
    "gpus": _int("Accelerators per pod (requests = limits).", default=1, minimum=0, maximum=16),
    "gpuResourceName": _str("Extended resource name of the accelerator.", default="nvidia.com/gpu",
                            pattern=RESOURCE_NAME_PATTERN, maxLength=253),
    "cpu": _str("CPU request (no limit: throttling stalls token streams).", default="2",
                pattern=QUANTITY_PATTERN),
    "memory": _str("Memory request and limit.", default="16Gi", pattern=QUANTITY_PATTERN),
    "shmSize": _str("Size limit of /dev/shm (a memory emptyDir). Default: 1Gi, or 2Gi per GPU when the "
                    "model is split over several (NCCL's buffers).", pattern=QUANTITY_PATTERN),
    "nodeSelector": _string_map("Node labels the pods must match."),
    "tolerations": {"type": "array", "description": "Pod tolerations (e.g. for GPU node taints).",
                    "items": _free_object("A core/v1 Toleration.")},
    "affinity": _free_object("A core/v1 Affinity."),
})

ENGINE = _obj("Engine settings, passed to `pagoda serve` as PAGODA_* environment variables.", default={},
              properties={
    "blockSize": _int("Tokens per KV-cache block.", default=ENGINE_DEFAULTS["block_size"], enum=[8, 16, 32, 64, 128]),
    "maxModelLen": _int("Max prompt + output tokens; default: the model's.", minimum=16, maximum=1048576),
    "maxNumSeqs": _int("Max sequences in the running batch.", default=ENGINE_DEFAULTS["max_num_seqs"], minimum=1, maximum=4096),
    "maxNumBatchedTokens": _int("Max tokens per engine step.", minimum=16, maximum=1048576),
    "gpuMemoryUtilization": _num("Share of GPU memory for weights + KV cache.",
                                 default=ENGINE_DEFAULTS["gpu_memory_utilization"],
                                 minimum=0.05, maximum=0.99),
    "enablePrefixCaching": _bool("Reuse KV blocks of shared prompt prefixes.",
                                 default=ENGINE_DEFAULTS["enable_prefix_caching"]),
    "enableChunkedPrefill": _bool("Prefill long prompts in chunks.",
                                  default=ENGINE_DEFAULTS["enable_chunked_prefill"]),
    "dtype": _str("Weights/KV dtype.", default=ENGINE_DEFAULTS["dtype"], enum=["auto", "bfloat16", "float16", "float32"]),
    "quantization": _str("Low-bit weight copies for one-row CPU steps: gguf (a GGUF model's own 4-bit "
                         "blocks), int4 (4-bit groups made at load from the dense weights, e.g. an HF "
                         "model's), none, or auto (gguf for a GGUF model on CPU, else none).",
                         default=ENGINE_DEFAULTS["quantization"], enum=list(QUANTIZATIONS)),
    "seed": _int("Seed for requests without their own.", minimum=0),
    "tensorParallelSize": _int("Ranks the model is split over (`--tensor-parallel-size`). Default: every GPU "
                               "of the group (resources.gpus × parallelism.nodes; 1 per node on CPU).",
                               minimum=1, maximum=1024),
    "extraArgs": {"type": "array", "description": "Extra `pagoda serve` arguments, appended verbatim.",
                  "items": {"type": "string", "maxLength": 1024}, "maxItems": 64},
}, **{"x-kubernetes-validations": [
    # The engine refuses this at start (a preempted sequence is recomputed in one unchunked step).
    {"rule": "!has(self.enableChunkedPrefill) || self.enableChunkedPrefill || !has(self.maxNumBatchedTokens)"
             " || !has(self.maxModelLen) || self.maxNumBatchedTokens >= self.maxModelLen",
     "message": "without chunked prefill, maxNumBatchedTokens must be at least maxModelLen"},
]})

PARALLELISM = _obj("Serving groups that span several nodes.", default={}, properties={
    "nodes": _int("Pods (one per node) of each serving group. Above 1 the group is a LeaderWorkerSet "
                  "(leaderworkerset.x-k8s.io/v1, its CRD must be installed): the leader serves, the other "
                  "pods run their nodes' tensor-parallel ranks, and spec.replicas counts groups.",
                  default=1, minimum=1, maximum=64),
})

ENV_VAR = _obj("An extra environment variable (value or valueFrom, as in a Pod).", {
    "name": _str("Variable name.", pattern=ENV_NAME_PATTERN, maxLength=256),
    "value": _str("Literal value."),
    "valueFrom": _free_object("A core/v1 EnvVarSource."),
}, required=["name"], **{"x-kubernetes-validations": [
    {"rule": "!(has(self.value) && has(self.valueFrom))", "message": "set value or valueFrom, not both"},
]})

AUTOSCALING = _obj("KV-cache aware autoscaling of spec.replicas (the operator's autoscaler).", default={},
                   properties={
    "enabled": _bool("Scale spec.replicas between minReplicas and maxReplicas.", default=False),
    "minReplicas": _int("Fewest replicas (at least 1: no scale-to-zero, nothing would wake it up).",
                        default=1),
    "maxReplicas": _int("Most replicas.", minimum=1, maximum=1000),
    "targetKVCacheUsage": _num("Target mean KV-cache usage per pod, 0-1.", default=0.7, minimum=0.05,
                               maximum=1),
    "targetQueueDepth": _num("Target waiting requests per pod.", default=4, minimum=0.1),
    "tolerance": _num("Ratio band around 1 within which nothing changes.", default=0.1, minimum=0,
                      maximum=0.9),
    "scaleUpStabilizationSeconds": _int("Window whose lowest proposal a scale-up takes.", default=0,
                                        minimum=0, maximum=3600),
    "scaleDownStabilizationSeconds": _int("Window whose highest proposal a scale-down takes.",
                                          default=300, minimum=0, maximum=3600),
    "scaleUpMaxPodsPerStep": _int("Most pods added per decision.", default=4, minimum=1),
    "scaleUpMaxPercentPerStep": _int("Most percent added per decision (the larger limit wins).",
                                     default=100, minimum=1),
    "intervalSeconds": _int("Seconds between metric collections and decisions.", default=15, minimum=1,
                            maximum=3600),
    "scrapeTimeoutSeconds": _num("Timeout of one pod scrape or Prometheus query.", default=2,
                                 minimum=0.1, maximum=60),
    "prometheusURL": _str("Read metrics from this Prometheus instead of scraping the pods.",
                          pattern=r"^https?://\S+$", maxLength=2048),
}, **{"x-kubernetes-validations": [
    {"rule": "!has(self.minReplicas) || self.minReplicas >= 1",
     "message": "minReplicas must be at least 1: scale to zero has no wake-up path"},
    {"rule": "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
     "message": "minReplicas must not exceed maxReplicas"},
    {"rule": "!self.enabled || has(self.maxReplicas)", "message": "maxReplicas is required when enabled"},
]})

MONITORING = _obj("Prometheus Operator integration.", default={}, properties={
    "serviceMonitor": _bool("Create a ServiceMonitor (only when its CRD is installed; a status "
                            "condition says when it is skipped).", default=True),
    "labels": _string_map("Extra labels on the ServiceMonitor, e.g. {release: kube-prometheus-stack}."),
    "interval": _str("Scrape interval.", default="15s", pattern=DURATION_PATTERN),
    "vllmCompatibleMetrics": _bool("Also export the pods' metrics under vLLM's names (vllm:*), for tools "
                                   "written for vLLM: KEDA examples, inference-perf, vLLM dashboards. "
                                   "routing.inferencePool turns it on too.", default=False),
})

ROUTING = _obj("Routing through the Kubernetes Gateway API inference extension.", default={}, properties={
    "inferencePool": _obj("An InferencePool (inference.networking.k8s.io/v1) selecting exactly this "
                          "service's serving pods, for a Gateway whose endpoint picker routes by queue "
                          "length and KV-cache use. Also labels the pods with the engine type the picker "
                          "reads and turns on the vLLM-compatible metric names.", default={}, properties={
        "enabled": _bool("Create the InferencePool (only when its CRD is installed; a status condition "
                         "says when it is skipped).", default=False),
        "endpointPicker": _obj("The endpoint picker Service the pool delegates to (installed with the "
                               "inference extension's chart).", default={}, properties={
            "name": _str("Service name; default: `<name>-epp`.", pattern=DNS_LABEL_PATTERN, maxLength=253),
            "port": _int("Service port of the picker's ext-proc gRPC.", default=9002, minimum=1, maximum=65535),
            "failureMode": _str("What the gateway does when the picker does not answer.", default="FailClose",
                                enum=["FailOpen", "FailClose"]),
        }),
    }),
})

SPEC = _obj("What to serve and how.", {
    "model": MODEL,
    "image": _str("Serving image; default: the operator's PAGODA_SERVER_IMAGE.", maxLength=512),
    "imagePullPolicy": _str("Image pull policy.", enum=["Always", "IfNotPresent", "Never"]),
    "imagePullSecrets": {"type": "array", "description": "Secrets for pulling the image.",
                         "items": _obj("A LocalObjectReference.", {
                             "name": _str("Secret name.", pattern=DNS_LABEL_PATTERN)}, required=["name"])},
    "replicas": _int("Desired serving pods (the scale subresource; the autoscaler writes it when enabled).",
                     default=1, minimum=0, maximum=1000),
    "storage": STORAGE,
    "resources": RESOURCES,
    "engine": ENGINE,
    "parallelism": PARALLELISM,
    "env": {"type": "array", "description": "Extra environment variables for the server container.",
            "items": ENV_VAR, "maxItems": 64,
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    "drainTimeoutSeconds": _int("Seconds a stopping pod keeps serving in-flight requests "
                                "(terminationGracePeriodSeconds = this + 10).", default=30, minimum=0,
                                maximum=3600),
    "startupTimeoutSeconds": _int("Seconds a pod may take to load the model before it is restarted.",
                                  default=1800, minimum=60, maximum=86400),
    "autoscaling": AUTOSCALING,
    "monitoring": MONITORING,
    "routing": ROUTING,
}, required=["model"], **{"x-kubernetes-validations": [
    # The engine refuses these at start: the 4-bit layers run on CPU kernels, unsharded.
    {"rule": "!has(self.engine) || !has(self.engine.quantization) || self.engine.quantization in ['auto', 'none'] "
             "|| (has(self.resources) && has(self.resources.gpus) && self.resources.gpus == 0 && "
             "(!has(self.engine.tensorParallelSize) || self.engine.tensorParallelSize == 1) && "
             "(!has(self.parallelism) || !has(self.parallelism.nodes) || self.parallelism.nodes == 1))",
     "message": "engine.quantization gguf and int4 run on CPU kernels on one rank: they need resources.gpus 0, "
                "one node and tensorParallelSize 1"},
    {"rule": "!has(self.engine) || !has(self.engine.tensorParallelSize) || !has(self.parallelism) || "
             "!has(self.parallelism.nodes) || self.engine.tensorParallelSize % self.parallelism.nodes == 0",
     "message": "engine.tensorParallelSize must be a multiple of parallelism.nodes (the same ranks on each node)"},
    # The pods of a group sit on different nodes and mount the one weight cache.
    {"rule": "!has(self.parallelism) || !has(self.parallelism.nodes) || self.parallelism.nodes == 1 || "
             "!has(self.model.uri) || !self.model.uri.startsWith('hf://') || !has(self.storage) || "
             "!has(self.storage.accessModes) || self.storage.accessModes.exists(m, m == 'ReadWriteMany')",
     "message": "parallelism.nodes > 1 with an hf:// model needs storage.accessModes ReadWriteMany (the group's "
                "pods on different nodes share the weight cache)"},
]})

CONDITION = _obj("A metav1.Condition.", {
    "type": _str("Ready, Progressing, Degraded, ServiceMonitor or InferencePool.", maxLength=316),
    "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
    "reason": _str("CamelCase reason.", maxLength=1024),
    "message": _str("Human-readable details.", maxLength=32768),
    "lastTransitionTime": _str("When status last changed.", format="date-time"),
    "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0,
                           "description": "The generation the condition was computed for."},
}, required=["type", "status", "lastTransitionTime"])

STATUS = _obj("What the operator observes.", {
    "observedGeneration": {"type": "integer", "format": "int64", "description": "Last reconciled generation."},
    "replicas": _int("Serving pods that exist (the scale subresource's status.replicas)."),
    "readyReplicas": _int("Pods passing /ready."),
    "updatedReplicas": _int("Pods running the current pod template."),
    "ready": _str("readyReplicas/spec.replicas, for `kubectl get`."),
    "selector": _str("Label selector of the serving pods (for the scale subresource)."),
    "endpoint": _str("OpenAI base URL inside the cluster."),
    "model": _str("The model name clients send (OpenAI `model`): spec.model.servedName, the uri's last "
                  "part, or the embedded model's name."),
    "group": _str("What one replica is: its pods and tensor-parallel ranks, e.g. `2 nodes × 8 GPUs, TP 16`."),
    "conditions": {"type": "array", "description": "Ready, Progressing, Degraded, ServiceMonitor, InferencePool.",
                   "items": CONDITION, "x-kubernetes-list-type": "map",
                   "x-kubernetes-list-map-keys": ["type"]},
    "kvCache": _obj("KV-cache capacity and usage as reported by the pods (the autoscaler's collection).", {
        "usage": _num("Mean KV blocks in use / total, 0-1.", minimum=0, maximum=1),
        "capacityTokens": {"type": "integer", "format": "int64", "description": "Tokens the pools hold."},
        "blockSize": _int("Tokens per block."),
        "numBlocks": {"type": "integer", "format": "int64", "description": "Blocks per pod."},
        "updatedAt": _str("When measured.", format="date-time"),
    }),
    "autoscaling": _obj("The autoscaler's last decision.", {
        "lastScaleTime": _str("When it last changed spec.replicas.", format="date-time"),
        "desiredReplicas": _int("What it wants."),
        "reason": _str("Why."),
        "metrics": _free_object("Per-pod metrics it read."),
        "proposals": _free_object("Per-metric replica proposals."),
        "history": {"type": "array", "description": "Recent recommendations the stabilization windows "
                    "can still pick (so a restarted operator does not flap).",
                    "items": {"type": "object", "required": ["time", "replicas"], "properties": {
                        "time": _str("When recommended.", format="date-time"),
                        "replicas": _int("Recommended replicas.")}}},
    }),
})

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".status.model",
     "description": "The name clients send as OpenAI `model`"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "KV", "type": "number", "jsonPath": ".status.kvCache.usage",
     "description": "Mean KV-cache usage, 0-1"},
    {"name": "Status", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Group", "type": "string", "jsonPath": ".status.group", "priority": 1,
     "description": "One replica: its nodes, GPUs and tensor-parallel ranks"},
    {"name": "Source", "type": "string", "jsonPath": ".spec.model.uri", "priority": 1,
     "description": "Where the weights come from (empty: the embedded model)"},
]


def schema() -> dict[str, Any]:
    """The openAPIV3Schema of an InferenceService."""
    return {"type": "object", "description": "An LLM served by pagoda pods with a paged KV cache.",
            "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                           "metadata": {"type": "object"}, "spec": SPEC, "status": STATUS},
            "required": ["spec"]}


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "pagoda"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": SHORT_NAMES, "categories": ["pagoda"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": schema()},
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def with_defaults(value: Any, node: dict[str, Any] | None = None) -> Any:
    """Apply the schema's defaults as the API server does: to absent fields of objects that exist.

    Sections the user may leave out (engine, resources, ...) default to `{}`, so their fields default too.
    """
    node = schema()["properties"]["spec"] if node is None else node
    if node.get("type") == "object" and isinstance(value, dict):
        result = copy.deepcopy(value)
        for name, child in node.get("properties", {}).items():
            if name not in result and "default" in child:
                result[name] = copy.deepcopy(child["default"])
            if name in result:
                result[name] = with_defaults(result[name], child)
        return result
    if node.get("type") == "array" and isinstance(value, list) and "items" in node:
        return [with_defaults(item, node["items"]) for item in value]
    return value


def section_defaults(name: str) -> dict[str, Any]:
    """The defaulted fields of one spec section (`autoscaling`, `engine`, ...): the schema's own defaults."""
    return with_defaults({}, SPEC["properties"][name])
