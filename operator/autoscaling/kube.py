"""The autoscaler's Kubernetes API calls: the scale subresource here; pods and status via the operator's
`pagoda.operator.kube` (both go through kopf's own authenticated API session)."""

from __future__ import annotations

from typing import Any

from kopf._cogs.clients import api as kopf_api
from kopf._core.engines.posting import settings_var
from pagoda.operator import crd
from pagoda.operator.kube import MERGE_PATCH, APIError, Logger, NotFound, list_pods, patch_status, path

__all__ = ["APIError", "NotFound", "get_scale", "list_pods", "patch_status", "set_replicas"]


async def get_scale(namespace: str, name: str, logger: Logger) -> dict[str, Any]:
    """The InferenceService's autoscaling/v1 Scale: spec.replicas, status.replicas, status.selector."""
    return await kopf_api.get(path(crd.API_VERSION, crd.PLURAL, namespace, name, "scale"),
                              settings=settings_var.get(), logger=logger)


async def set_replicas(namespace: str, name: str, replicas: int, logger: Logger) -> None:
    """Write spec.replicas through the scale subresource, as the HPA and KEDA do."""
    await kopf_api.patch(path(crd.API_VERSION, crd.PLURAL, namespace, name, "scale"),
                         payload={"spec": {"replicas": replicas}}, headers=MERGE_PATCH,
                         settings=settings_var.get(), logger=logger)
