"""The only code that writes children: server-side apply (field manager `pagoda-operator`, force).

Apply sends the whole desired object every time: the API server merges it with what others own
(the autoscaler's replicas via our spec, kubectl annotations, defaulted fields), removes fields we
applied before and dropped since, and answers with no change when nothing differs, so re-running a
reconcile (operator restart, resume) writes nothing new. Owner references come from `render`, so
deleting the InferenceService garbage-collects every child.
"""

from __future__ import annotations

from typing import Any

from pagoda.operator import kube
from pagoda.operator.kube import APIError, Logger, NotFound, path
from pagoda.operator.render import FIELD_MANAGER, KINDS, ChildKind, Desired

APPLY_PATCH = {"Content-Type": "application/apply-patch+yaml"}  # a JSON body is valid YAML


def object_path(obj: dict[str, Any], **query: str) -> str:
    kind = KINDS[obj["kind"]]
    meta = obj["metadata"]
    return path(kind.api_version, kind.plural, meta.get("namespace"), meta["name"], **query)


async def apply(obj: dict[str, Any], logger: Logger) -> dict[str, Any]:
    return await kube.patch(object_path(obj, fieldManager=FIELD_MANAGER, force="true"), obj, APPLY_PATCH, logger)


async def delete_if_present(kind: ChildKind, namespace: str, name: str, logger: Logger) -> bool:
    try:
        await kube.delete(path(kind.api_version, kind.plural, namespace, name), logger)
    except NotFound:
        return False
    return True


class ApplyError(Exception):
    """The API refused some children (the message names each one and why)."""


async def apply_desired(desired: Desired, namespace: str, logger: Logger) -> list[dict[str, Any]]:
    """Apply every desired object, then delete the ones that must not exist; returns what the API stored.

    One refused object (say, a PVC change the API cannot make) does not hold back the others.
    """
    stored, refused = [], []
    for obj in desired.objects:
        try:
            stored.append(await apply(obj, logger))
        except APIError as exc:
            refused.append(f"{obj['kind']} {obj['metadata']['name']}: {exc}")
    for kind, name in desired.absent:
        if await delete_if_present(kind, namespace, name, logger):
            logger.info(f"deleted {kind.kind} {name}: no longer wanted")
    if refused:
        raise ApplyError("; ".join(refused))
    return stored
