"""A Kubernetes API emulator for operator tests: kmock 0.8's emulator plus the server behaviour we rely on.

kmock's `KubernetesEmulator` stores objects and serves list/watch/get/create/patch/delete over real
HTTP, but as a plain dict store. This subclass adds, in one place, what the real API server does and
our operators depend on:

- server-assigned metadata: uid, creationTimestamp, resourceVersion (every write), generation (bumped
  when `spec` changes), names from `generateName` (kopf's Events collide without it);
- status subresource isolation: a PATCH of the object ignores `status`, a PATCH of `/status` changes
  only `status` (for resources declared with the `status` subresource);
- the `scale` subresource: GET/PATCH `.../scale` read and write an `autoscaling/v1` Scale
  (`spec.replicas`, `status.replicas`, `status.selector`);
- server-side apply (`application/apply-patch+yaml`): creates an absent object (kmock answers 404),
  requires `fieldManager`, and removes fields the same manager applied before but no longer applies
  (maps only; lists are atomic, as for most lists without a merge key);
- `labelSelector` filtering on list and watch (=, ==, !=, in, notin, exists, !exists);
- list resourceVersions, and watches from them that do not replay what the list already returned;
- parsing of `/api/v1/namespaces[/name]` (kmock 0.8 fails on it: kopf lists namespaces when it serves
  only some of them);
- garbage collection: objects whose owners (ownerReferences uids) are all gone are deleted;
- no-op writes (a patch or apply that changes nothing) store no new version and send no watch event;
- a JSON patch whose `test` op fails answers 422, as the API server does (kmock answers 500).

Not emulated: schema validation/defaulting, strategic-merge of lists, field-ownership conflicts between
managers, resourceVersion preconditions (optimistic locking), status stripped on create, controllers
(no Deployment makes Pods: tests create Pods themselves), PUT, fieldSelector, watch timeouts and
bookmarks, admission, RBAC (the requests are recorded, so a test can check them against a Role).
"""

from __future__ import annotations

import copy
import datetime
import itertools
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts, parsing, rendering

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete", "deletecollection"}

# Built-in resources an operator usually touches: key = "group/version/plural" (core: "v1/plural").
BUILTIN_RESOURCES: dict[str, kmock.ResourceInfo] = {
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", singular="namespace", namespaced=False, verbs=VERBS),
    "v1/events": kmock.ResourceInfo(kind="Event", singular="event", namespaced=True, verbs=VERBS),
    "v1/pods": kmock.ResourceInfo(kind="Pod", singular="pod", namespaced=True, verbs=VERBS,
                                  subresources={"status"}),
    "v1/services": kmock.ResourceInfo(kind="Service", singular="service", namespaced=True, verbs=VERBS,
                                      subresources={"status"}),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", singular="secret", namespaced=True, verbs=VERBS),
    "v1/persistentvolumeclaims": kmock.ResourceInfo(kind="PersistentVolumeClaim",
                                                    singular="persistentvolumeclaim", namespaced=True,
                                                    verbs=VERBS, subresources={"status"}),
    "apps/v1/deployments": kmock.ResourceInfo(kind="Deployment", singular="deployment", namespaced=True,
                                              verbs=VERBS, subresources={"status", "scale"}),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(kind="PodDisruptionBudget",
                                                         singular="poddisruptionbudget", namespaced=True,
                                                         verbs=VERBS, subresources={"status"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False, verbs=VERBS,
        subresources={"status"}),
    "kopf.dev/v1/clusterkopfpeerings": kmock.ResourceInfo(kind="ClusterKopfPeering",
                                                          singular="clusterkopfpeering",
                                                          namespaced=False, verbs=VERBS),
    "kopf.dev/v1/kopfpeerings": kmock.ResourceInfo(kind="KopfPeering", singular="kopfpeering",
                                                   namespaced=True, verbs=VERBS),
}
SERVICE_MONITORS = "monitoring.coreos.com/v1/servicemonitors"
SERVICE_MONITOR_INFO = kmock.ResourceInfo(kind="ServiceMonitor", singular="servicemonitor",
                                          namespaced=True, verbs=VERBS)
INFERENCE_POOLS = "inference.networking.k8s.io/v1/inferencepools"
INFERENCE_POOL_INFO = kmock.ResourceInfo(kind="InferencePool", singular="inferencepool",
                                         namespaced=True, verbs=VERBS, shortnames={"infpool"})
LEADER_WORKER_SETS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
LEADER_WORKER_SET_INFO = kmock.ResourceInfo(kind="LeaderWorkerSet", singular="leaderworkerset", namespaced=True,
                                            verbs=VERBS, shortnames={"lws"}, subresources={"status", "scale"})


def _parse_path_with_namespaces(path: str) -> parsing.ParsedPath:
    """kmock 0.8 cannot parse the `namespaces` resource itself (`/api/v1/namespaces[/name]`): it reads
    the word as the namespace prefix of a namespaced path and fails. Parse those two forms here."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None)
    return _kmock_parse_path(path)


_kmock_parse_path = parsing.parse_path
parsing.parse_path = _parse_path_with_namespaces


def declare_builtin_resources(emulator: kmock.KubernetesEmulator, *, service_monitors: bool = False,
                              inference_pools: bool = False, leader_worker_sets: bool = False) -> None:
    """Declare the built-in resources (kopf starts no watch on undeclared ones), and optionally the
    CRD-defined kinds the operator looks for (ServiceMonitor, InferencePool, LeaderWorkerSet)."""
    for key, info in BUILTIN_RESOURCES.items():
        emulator.resources[key] = attrs.evolve(info)
    if service_monitors:
        emulator.resources[SERVICE_MONITORS] = attrs.evolve(SERVICE_MONITOR_INFO)
    if inference_pools:
        emulator.resources[INFERENCE_POOLS] = attrs.evolve(INFERENCE_POOL_INFO)
    if leader_worker_sets:
        emulator.resources[LEADER_WORKER_SETS] = attrs.evolve(LEADER_WORKER_SET_INFO)


def declare_crd(emulator: kmock.KubernetesEmulator, crd: Mapping[str, Any]) -> str:
    """Declare a CustomResourceDefinition's served versions; returns the key of the storage version."""
    spec, names = crd["spec"], crd["spec"]["names"]
    storage_key = ""
    for version in spec["versions"]:
        key = f"{spec['group']}/{version['name']}/{names['plural']}"
        emulator.resources[key] = kmock.ResourceInfo(
            kind=names["kind"], singular=names.get("singular", names["kind"].lower()),
            namespaced=spec["scope"] == "Namespaced", verbs=VERBS,
            shortnames=set(names.get("shortNames", [])), categories=set(names.get("categories", [])),
            subresources=set(version.get("subresources", {})))
        if version.get("storage"):
            storage_key = key
    return storage_key


# --- label selectors ---------------------------------------------------------------------------------

_SET_TERM = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(notin|in)\s*\(([^)]*)\)|(==|=|!=)\s*([\w.-]*))?\s*$")


def _split_selector(selector: str) -> list[str]:
    """Split on commas outside parentheses (`a in (x,y),b=c` → two terms)."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [*terms, current] if current.strip() else terms


def labels_match(selector: str, labels: Mapping[str, str]) -> bool:
    """Evaluate a Kubernetes label selector string against an object's labels."""
    for term in _split_selector(selector):
        found = _SET_TERM.match(term)
        if found is None:
            raise ValueError(f"unsupported label selector term: {term!r}")
        negated, key, set_op, values, eq_op, value = found.groups()
        if set_op:
            wanted = {v.strip() for v in values.split(",")}
            ok = labels.get(key) in wanted if set_op == "in" else labels.get(key) not in wanted
        elif eq_op:
            ok = labels.get(key) == value if eq_op in ("=", "==") else labels.get(key) != value
        else:
            ok = (key in labels) != bool(negated)
        if not ok:
            return False
    return True


def _selector_of(request: rendering.Request) -> str:
    return request.params.get("labelSelector", "")


# --- the emulator ------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with server-assigned metadata, subresources, apply, selectors and GC."""

    _resource_versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_rv: int = attrs.field(default=0, init=False)
    # (resource, namespace, name, field manager) → the last configuration that manager applied
    _applied: dict[tuple[Any, str | None, str, str], dict[str, Any]] = attrs.field(factory=dict, init=False)

    def _next_rv(self) -> str:
        self._last_rv = next(self._resource_versions)
        return str(self._last_rv)

    def _has_subresource(self, resource: Any, subresource: str) -> bool:
        return resource in self.resources and subresource in self.resources[resource].subresources

    def _stored(self, request: rendering.Request) -> kmock.Object | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key]
        return None

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        try:
            return await self._handle_emulated(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            # The API server answers a JSON patch whose `test` op fails with 422 (kopf retries on its
            # next cycle); kmock would answer 500 and kopf would retry the same stale patch.
            raise kmock.KubernetesError(422, "Invalid", f"the object has been modified: {exc}") from exc

    async def _handle_emulated(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None:
            return await super()._handle(request)
        if request.subresource == "scale" and request.action in (kmock.action.FETCH, kmock.action.UPDATE):
            return await self._serve_scale(request)
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            _rewrite(request, data=self._stamp_new(request.data, request.namespace))
        elif request.action == kmock.action.UPDATE and request.name is not None:
            if request.headers.get("Content-Type", "").startswith(APPLY_CONTENT_TYPE):
                manager = request.params.get("fieldManager")
                if not manager:
                    raise kmock.KubernetesError(400, "BadRequest", "fieldManager is required for apply")
                if self._stored(request) is None:  # apply creates
                    self._applied[request.resource, request.namespace, request.name, manager] = \
                        copy.deepcopy(request.data)
                    _rewrite(request, action=kmock.action.CREATE,
                             data=self._stamp_new(copy.deepcopy(request.data), request.namespace))
                    return await super()._handle(request)
                _rewrite(request, data=self._apply_as_merge(request, manager))
            stored = self._stored(request)
            if stored is not None and not self._changes(request, stored):
                return aiohttp.web.json_response(stored.raw)  # a no-op write: no new version, no event
            _rewrite(request, data=self._isolate_and_stamp(request))
        response = await super()._handle(request)
        if request.action in (kmock.action.DELETE, kmock.action.UPDATE):
            await self._collect_garbage()
        return response

    # --- writes ---

    def _stamp_new(self, data: dict[str, Any], namespace: str | None) -> dict[str, Any]:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if namespace and not meta.get("namespace"):
            meta["namespace"] = namespace
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["resourceVersion"] = self._next_rv()
        meta["generation"] = 1
        return data

    def _apply_as_merge(self, request: rendering.Request, manager: str) -> dict[str, Any]:
        """Server-side apply as a merge patch: fields this manager applied before and dropped now → None."""
        key = (request.resource, request.namespace, request.name, manager)
        previous = self._applied.get(key, {})
        self._applied[key] = copy.deepcopy(request.data)
        return _with_removals(copy.deepcopy(request.data), previous)

    def _isolated(self, request: rendering.Request) -> Any:
        """The part of a patch this endpoint may change (status subresource isolation)."""
        data = request.data
        if isinstance(data, dict) and self._has_subresource(request.resource, "status"):
            if request.subresource == "status":
                return {"status": data.get("status")} if "status" in data else {}
            if request.subresource is None:
                return {k: v for k, v in data.items() if k != "status"}
        return data

    def _changes(self, request: rendering.Request, stored: kmock.Object) -> bool:
        return dicts.patch_dict(copy.deepcopy(stored.raw), self._isolated(request)) != stored.raw

    def _isolate_and_stamp(self, request: rendering.Request) -> Any:
        stored = self._stored(request)
        if stored is None:
            return request.data  # kmock answers 404
        data = self._isolated(request)
        before = stored.raw
        after = dicts.patch_dict(copy.deepcopy(before), data)
        meta = before.get("metadata", {})
        stamps = {"resourceVersion": self._next_rv()}
        if after.get("spec") != before.get("spec"):
            stamps["generation"] = int(meta.get("generation", 1)) + 1
        if isinstance(data, dict):
            return dicts.patch_dict(data, {"metadata": stamps})
        return [*data, *({"op": "add", "path": f"/metadata/{k}", "value": v} for k, v in stamps.items())]

    async def _serve_scale(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if not self._has_subresource(request.resource, "scale"):
            raise kmock.KubernetesNotFoundError()
        stored = self._stored(request)
        if stored is None:
            raise kmock.KubernetesObjectNotFoundError()
        if request.action == kmock.action.UPDATE:
            replicas = (request.data or {}).get("spec", {}).get("replicas")
            if replicas is not None:
                _rewrite(request, subresource=None, data={"spec": {"replicas": replicas}})
                _rewrite(request, data=self._isolate_and_stamp(request))
                await super()._handle(request)
                _rewrite(request, subresource="scale")
            stored = self._stored(request)
            assert stored is not None
        return aiohttp.web.json_response(_scale_of(stored.raw))

    async def _collect_garbage(self) -> None:
        """Delete (in the background, as the real GC) every object whose owners are all gone."""
        async with self._lock:
            while True:
                live_uids = {obj.raw.get("metadata", {}).get("uid")
                             for obj in self.objects.values() if not obj.deleted}
                orphans = [(key, obj) for key, obj in self.objects.items()
                           if not obj.deleted and (owners := obj.raw.get("metadata", {}).get("ownerReferences"))
                           and not any(owner.get("uid") in live_uids for owner in owners)]
                if not orphans:
                    return
                for (resource, _, _), obj in orphans:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})

    # --- reads ---

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        result = await super()._serve_list(request)
        result["metadata"]["resourceVersion"] = str(self._last_rv)  # kmock answers "..."
        if selector := _selector_of(request):
            result["items"] = [item for item in result["items"]
                               if labels_match(selector, item.get("metadata", {}).get("labels") or {})]
        return result

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        """kmock replays every object as ADDED when a watch starts; a watch from a list's
        resourceVersion gets only what is newer, as from the real API server."""
        selector = _selector_of(request)
        since = request.params.get("resourceVersion", "")
        async for event in super()._serve_watch(request):
            if not isinstance(event, dict):
                yield event
                continue
            meta = event.get("object", {}).get("metadata", {})
            replayed = (event.get("type") == "ADDED" and since.isdigit()
                        and str(meta.get("resourceVersion", "")).isdigit()
                        and int(meta["resourceVersion"]) <= int(since))
            if not replayed and (not selector or labels_match(selector, meta.get("labels") or {})):
                yield event


def _rewrite(request: rendering.Request, **fields: Any) -> None:
    """Change a recorded request in place: kmock's reactions only see the request object it recorded."""
    for name, value in fields.items():
        object.__setattr__(request, name, value)


def _with_removals(applied: dict[str, Any], previous: Mapping[str, Any]) -> dict[str, Any]:
    """Mark keys of `previous` that `applied` no longer has as None (a merge-patch deletion)."""
    for key, old in previous.items():
        if key not in applied:
            applied[key] = None
        elif isinstance(old, Mapping) and isinstance(applied[key], dict):
            _with_removals(applied[key], old)
    return applied


def _scale_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The autoscaling/v1 Scale view of an object (CRs: .status.selector, LeaderWorkerSets:
    .status.hpaPodSelector; Deployments: spec.selector)."""
    spec, status, meta = obj.get("spec", {}), obj.get("status", {}) or {}, obj.get("metadata", {})
    selector = status.get("selector") or status.get("hpaPodSelector")
    if selector is None and (match_labels := spec.get("selector", {}).get("matchLabels")):
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
    return {
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                     if k in meta},
        "spec": {"replicas": spec.get("replicas", 0)},
        "status": {"replicas": status.get("replicas", 0), **({"selector": selector} if selector else {})},
    }
