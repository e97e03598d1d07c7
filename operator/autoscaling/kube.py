"""The autoscaler's Kubernetes API calls: the scale subresource here; pods and status via the operator's
`pagoda.operator.kube` (all through kopf's own authenticated API session, whose calls live there)."""

from __future__ import annotations

from typing import Any

from pagoda.operator import crd
from pagoda.operator.kube import (
    MERGE_PATCH,
    APIError,
    Logger,
    NotFound,
    get_existing,
    list_pods,
    patch,
    patch_status,
    path,
)

__all__ = ["APIError", "NotFound", "get_scale", "list_pods", "patch_status", "set_replicas"]


async def get_scale(namespace: str, name: str, logger: Logger) -> dict[str, Any]:
    """The InferenceService's autoscaling/v1 Scale: spec.replicas, status.replicas, status.selector."""
    return await get_existing(path(crd.API_VERSION, crd.PLURAL, namespace, name, "scale"), logger)


async def set_replicas(namespace: str, name: str, replicas: int, logger: Logger) -> None:
    """Write spec.replicas through the scale subresource, as the HPA and KEDA do."""
    await patch(path(crd.API_VERSION, crd.PLURAL, namespace, name, "scale"), {"spec": {"replicas": replicas}},
                MERGE_PATCH, logger)
