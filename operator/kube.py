"""Kubernetes API paths and reads, through kopf's own authenticated API session.

kopf already holds the credentials (in-cluster service account, kubeconfig or a login handler),
re-authenticates on 401 and retries transient errors, so the operator uses that one session for its
own calls too (as the autoscaler does). kopf exposes it only under `kopf._cogs`, so every private
kopf import of the project is here (the peering tests' too, at the bottom). What to write to children
lives in `apply.py`; this module has the calls.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

from kopf._cogs.aiokits.aioenums import FlagSetter as DaemonStopper  # the daemons' pause tests stop with it
from kopf._cogs.clients import api as kopf_api
from kopf._cogs.clients import errors as kopf_errors
from kopf._cogs.structs import references as peering_references  # the peering tests check the chart's CRDs
from kopf._core.engines.peering import (
    Identity as PeeringIdentity,  # with them, and operator identities with this
)
from kopf._core.engines.posting import settings_var
from pagoda.operator import crd

APIError = kopf_errors.APIError
NotFound = kopf_errors.APINotFoundError
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
Logger = logging.Logger | logging.LoggerAdapter


def path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
         subresource: str | None = None, **query: str) -> str:
    """`/api/v1/...` for the core group, `/apis/group/version/...` otherwise."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base, *(["namespaces", namespace] if namespace else []), plural,
             *([name] if name else []), *([subresource] if subresource else [])]
    url = "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))
    return f"{url}?{urlencode(query, quote_via=quote)}" if query else url


async def get(url: str, logger: Logger) -> dict[str, Any] | None:
    try:
        return await get_existing(url, logger)
    except NotFound:
        return None


async def get_existing(url: str, logger: Logger) -> dict[str, Any]:
    """GET that raises `NotFound` for a missing object."""
    return await kopf_api.get(url, settings=settings_var.get(), logger=logger)


async def patch(url: str, payload: Mapping[str, Any], headers: Mapping[str, str], logger: Logger) -> dict[str, Any]:
    return await kopf_api.patch(url, payload=dict(payload), headers=dict(headers), settings=settings_var.get(),
                                logger=logger)


async def delete(url: str, logger: Logger) -> None:
    await kopf_api.delete(url, settings=settings_var.get(), logger=logger)


async def get_deployment(namespace: str, name: str, logger: Logger) -> dict[str, Any] | None:
    return await get(path("apps/v1", "deployments", namespace, name), logger)


async def list_pods(namespace: str, selector: str, logger: Logger) -> list[dict[str, Any]]:
    result = await get(path("v1", "pods", namespace, labelSelector=selector), logger)
    return list((result or {}).get("items") or [])


async def serves(api_version: str, plural: str, logger: Logger) -> bool:
    """Whether the cluster serves a resource (discovery: no RBAC needed, no CRD read)."""
    group_version = await get(f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}", logger)
    return any(r.get("name") == plural for r in (group_version or {}).get("resources") or [])


async def patch_status(namespace: str, name: str, status: Mapping[str, Any], logger: Logger) -> None:
    """Merge-patch our InferenceService's status subresource (None values delete keys)."""
    await patch(path(crd.API_VERSION, crd.PLURAL, namespace, name, "status"), {"status": dict(status)},
                MERGE_PATCH, logger)

__all__ = ["MERGE_PATCH", "APIError", "DaemonStopper", "Logger", "NotFound", "PeeringIdentity", "delete", "get",
           "get_deployment", "get_existing", "list_pods", "patch", "patch_status", "path", "peering_references",
           "serves"]
