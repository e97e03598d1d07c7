"""The autoscaler's few Kubernetes API calls, made through kopf's own authenticated API session.

Why kopf's client: the autoscaler runs inside kopf's handlers, and kopf already holds the credentials
(in-cluster service account, kubeconfig or a login handler), re-authenticates on 401 and retries
transient errors; a second client would need its own configuration. kopf exposes this session only in
`kopf._cogs` (not public API), so every use of it is kept in this one module.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from kopf._cogs.clients import api as kopf_api
from kopf._cogs.clients import errors as kopf_errors
from kopf._core.engines.posting import settings_var

GROUP, VERSION, PLURAL = "serving.pagoda.dev", "v1alpha1", "inferenceservices"
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}

NotFound = kopf_errors.APINotFoundError
APIError = kopf_errors.APIError


def _url(namespace: str, name: str, subresource: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/{subresource}"


async def get_scale(namespace: str, name: str, logger: logging.Logger | Any) -> dict[str, Any]:
    """The InferenceService's autoscaling/v1 Scale: spec.replicas, status.replicas, status.selector."""
    return await kopf_api.get(_url(namespace, name, "scale"), settings=settings_var.get(), logger=logger)


async def set_replicas(namespace: str, name: str, replicas: int, logger: logging.Logger | Any) -> None:
    """Write spec.replicas through the scale subresource, as the HPA and KEDA do."""
    await kopf_api.patch(_url(namespace, name, "scale"), payload={"spec": {"replicas": replicas}},
                         headers=MERGE_PATCH, settings=settings_var.get(), logger=logger)


async def patch_status(namespace: str, name: str, status: Mapping[str, Any],
                       logger: logging.Logger | Any) -> None:
    await kopf_api.patch(_url(namespace, name, "status"), payload={"status": status}, headers=MERGE_PATCH,
                         settings=settings_var.get(), logger=logger)


async def list_pods(namespace: str, selector: str, logger: logging.Logger | Any) -> list[dict[str, Any]]:
    url = f"/api/v1/namespaces/{namespace}/pods?labelSelector={quote(selector)}"
    result = await kopf_api.get(url, settings=settings_var.get(), logger=logger)
    return list(result.get("items") or [])
