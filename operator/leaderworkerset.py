"""Models bigger than one GPU: tensor-parallel sizing, and multi-node groups as a LeaderWorkerSet.

- One node: `resources.gpus: N` runs `pagoda serve --tensor-parallel-size N` (engine.tensorParallelSize
  overrides), and /dev/shm grows with the GPUs (NCCL's intra-node buffers live there).
- `spec.parallelism.nodes > 1`: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) replaces the
  Deployment. Each replica is a group of `nodes` pods: the leader runs `pagoda serve` (rank 0 and its
  node's other ranks), each worker pod runs `pagoda worker` for its node's ranks and joins the leader
  through the address LWS gives every pod (LWS_LEADER_ADDRESS). Both pods carry the same security
  context, weight cache and probes (the worker answers /health and /ready for its ranks). Workers are
  labelled with their own component, so the Service, the PDB, status, the scale subresource and the
  autoscaler see the leaders only: a group is one replica. A pod that fails recreates its group
  (restartPolicy RecreateGroupOnPodRestart): the ranks of a group only work together.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pagoda.operator.weights import DOWNLOAD_MARKER

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
WORKER_COMPONENT = "inference-worker"
RENDEZVOUS_PORT = 29500  # torch.distributed's usual MASTER_PORT, on the leader pod
SHM_PER_GPU_GIB = 2
WAIT_CONTAINER = "wait-for-weights"
# A worker pod shares the leader's weight cache: it waits for the leader's download to complete
# instead of downloading into the same folder at the same time.
WAIT_SCRIPT = f"""\
import os, pathlib, time
marker = pathlib.Path(os.environ["PAGODA_MODEL"]) / "{DOWNLOAD_MARKER}"
while not marker.is_file():
    print(f"waiting for the group's leader to download the model into {{marker.parent}}", flush=True)
    time.sleep(10)
"""


def nodes(spec: Mapping[str, Any]) -> int:
    return int((spec.get("parallelism") or {}).get("nodes", 1))


def wanted(spec: Mapping[str, Any]) -> bool:
    return nodes(spec) > 1


def tensor_parallel_size(spec: Mapping[str, Any]) -> int:
    """engine.tensorParallelSize, else every GPU of the group (one rank per GPU; 1 per CPU node)."""
    explicit = spec["engine"].get("tensorParallelSize")
    return int(explicit) if explicit else max(1, int(spec["resources"]["gpus"])) * nodes(spec)


def shm_size(spec: Mapping[str, Any]) -> str:
    """resources.shmSize when set, else 1Gi, or 2Gi per GPU of a pod with several (NCCL's buffers)."""
    resources = spec["resources"]
    gpus = int(resources["gpus"])
    return resources.get("shmSize") or (f"{SHM_PER_GPU_GIB * gpus}Gi" if gpus > 1 else "1Gi")


def parallel_env(spec: Mapping[str, Any]) -> dict[str, Any]:
    """PAGODA_* variables of tensor parallelism (none for a one-rank pod, so its template is unchanged)."""
    size = tensor_parallel_size(spec)
    values: dict[str, Any] = {}
    if size > 1:
        values["PAGODA_TENSOR_PARALLEL_SIZE"] = size
    if wanted(spec):
        values |= {"PAGODA_NNODES": nodes(spec), "MASTER_PORT": RENDEZVOUS_PORT}
    return values


def worker_template(leader: dict[str, Any], component_label: str) -> dict[str, Any]:
    """The leader's pod template, running `pagoda worker` for its node's ranks instead of the server."""
    template = copy.deepcopy(leader)
    template["metadata"]["labels"][component_label] = WORKER_COMPONENT
    container = template["spec"]["containers"][0]
    container["command"] = ["pagoda", "worker"]
    container["env"] = [
        *container["env"],
        {
            "name": "PAGODA_NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{WORKER_INDEX_LABEL}']"}},
        },
    ]
    container["ports"] = [
        {"name": "http", "containerPort": container["ports"][0]["containerPort"], "protocol": "TCP"}
    ]
    waits = [_waiting(init) for init in template["spec"].pop("initContainers", [])]
    if waits:
        template["spec"]["initContainers"] = waits
    return template


def _waiting(download: dict[str, Any]) -> dict[str, Any]:
    model = [e for e in download["env"] if e["name"] == "PAGODA_MODEL"]
    kept = {k: v for k, v in download.items() if k not in ("env", "command", "terminationMessagePolicy")}
    return {
        **kept,
        "name": WAIT_CONTAINER,
        "command": ["python", "-c", WAIT_SCRIPT],
        "env": model,
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
    }


def leader_worker_set(
    metadata: dict[str, Any], spec: Mapping[str, Any], leader: dict[str, Any], component_label: str
) -> dict[str, Any]:
    leader = copy.deepcopy(leader)
    leader["spec"]["containers"][0]["ports"].append(
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}
    )
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "replicas": spec["replicas"],  # groups: the InferenceService's scale subresource
            "startupPolicy": "LeaderCreated",
            # One extra group at a time, never one fewer serving (as the Deployment's rollout).
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": nodes(spec),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker_template(leader, component_label),
            },
        },
    }


def as_workload(lws: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A LeaderWorkerSet read as the Deployment fields status.py reads (counts are groups). LWS writes
    no observedGeneration: its counts are taken as current."""
    if lws is None:
        return None
    lws_status = dict(lws.get("status") or {})
    generation = (lws.get("metadata") or {}).get("generation", 0)
    return {
        "metadata": {"generation": generation},
        "status": {
            **{k: lws_status.get(k) for k in ("replicas", "readyReplicas", "updatedReplicas")},
            "observedGeneration": generation,
        },
    }
