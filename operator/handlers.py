"""kopf handlers: thin. Reconcile = render (pure) → apply (SSA) → observe → status (pure) → patch.

- create / update of spec / resume (operator start): `reconcile`;
- one daemon per InferenceService refreshes status every `CONFIG.status_interval` seconds from the
  Deployment and its pods (server-side label selector), writing only what changed;
- Events for Ready/Degraded transitions. The spec (and so hfTokenSecretRef) is never logged.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import Any

import kopf
from pagoda.operator import apply, crd, daemons, kube, operator_metrics, render, routing, status
from pagoda.operator import leaderworkerset as lws

GROUP, VERSION, PLURAL = crd.GROUP, crd.VERSION, crd.PLURAL
SERVICE_MONITOR_API = "monitoring.coreos.com/v1"


@dataclass
class OperatorConfig:
    """Set by `pagoda operator` (and tests) before the operator starts."""

    status_interval: float = 10.0
    default_image: str = ""

    def image(self) -> str:
        return (self.default_image or os.environ.get("PAGODA_SERVER_IMAGE")
                or f"ghcr.io/pagoda-dev/pagoda-server:{importlib.metadata.version('pagoda')}")


CONFIG = OperatorConfig()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf's bookkeeping goes to annotations: status is ours (and the schema prunes unknown fields).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events say what matters; no "handler succeeded"
    # Watches end server-side every 5 minutes and are re-listed: a silently dead connection cannot
    # leave the operator blind for longer than that.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


LAST_STATUS, STATUS_LOCK = "pagoda_last_status", "pagoda_status_lock"  # keys in kopf's per-object memo


def _status_lock(memo: kopf.Memo) -> asyncio.Lock:
    """Reconcile and the refresh daemon of one object write status one at a time."""
    return memo.setdefault(STATUS_LOCK, asyncio.Lock())


def _last_status(body: kopf.Body, memo: kopf.Memo) -> dict[str, Any]:
    """What we wrote last: the watch event that brings it into `body` may not have arrived yet."""
    return dict(memo.get(LAST_STATUS) or body.get("status") or {})


async def _publish_status(body: kopf.Body, memo: kopf.Memo, new: dict[str, Any], old: dict[str, Any],
                          logger: kopf.Logger) -> None:
    """Write what changed and post Events for the transitions."""
    changes = status.status_changes(new, old)
    if not changes:
        return
    meta = body["metadata"]
    await kube.patch_status(meta["namespace"], meta["name"], changes, logger)
    memo[LAST_STATUS] = {k: v for k, v in {**old, **new}.items() if v is not None}
    for kind, reason, message in status.transitions(new["conditions"], old.get("conditions") or []):
        kopf.event(body, type=kind, reason=reason, message=message)


async def _observe(owner: render.Owner, spec: dict[str, Any], logger: kopf.Logger,
                   apply_error: str | None) -> status.Observation:
    if lws.wanted(spec):
        url = kube.path(lws.API_VERSION, lws.PLURAL, owner.namespace, owner.name)
        deployment = lws.as_workload(await kube.get(url, logger))
    else:
        deployment = await kube.get_deployment(owner.namespace, owner.name, logger)
    pods = await kube.list_pods(owner.namespace, render.selector_string(owner), logger)
    return status.Observation(deployment, pods, apply_error)


def optional_child_state(wanted: bool, served: bool) -> str:
    return "Disabled" if not wanted else "Created" if served else "CRDNotFound"


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger,
                    **_: Any) -> None:
    try:
        await _reconcile(body, dict(spec), meta.get("generation", 0), memo, logger)
    except Exception:
        operator_metrics.RECONCILES.labels("error").inc()
        raise
    operator_metrics.RECONCILES.labels("success").inc()


async def _reconcile(body: kopf.Body, spec: dict[str, Any], generation: int, memo: kopf.Memo,
                     logger: kopf.Logger) -> None:
    owner = render.Owner.of(body)
    defaulted = crd.with_defaults(spec)
    # asked every time: the Prometheus Operator may be installed (or removed) after us
    monitors_served = await kube.serves(SERVICE_MONITOR_API, render.SERVICE_MONITOR.plural, logger)
    pools_served = await kube.serves(render.INFERENCE_POOL.api_version, render.INFERENCE_POOL.plural, logger)
    groups_served = await kube.serves(lws.API_VERSION, lws.PLURAL, logger)
    try:
        desired = render.render(owner, defaulted, default_image=CONFIG.image(), service_monitors_served=monitors_served,
                                inference_pools_served=pools_served, leader_worker_sets_served=groups_served)
    except ValueError as exc:  # the schema refuses these; only an unvalidated object gets here
        raise kopf.PermanentError(str(exc)) from exc
    apply_error = None
    try:
        await apply.apply_desired(desired, owner.namespace, logger)
    except apply.ApplyError as exc:
        apply_error = f"the API refused: {exc}"
        operator_metrics.ERRORS.labels("apply").inc()
    monitor_state = optional_child_state(render.service_monitor_wanted(defaulted), monitors_served)
    pool_state = optional_child_state(routing.pool_wanted(defaulted), pools_served)
    group_state = optional_child_state(lws.wanted(defaulted), groups_served)
    async with _status_lock(memo):
        previous = _last_status(body, memo)
        observation = await _observe(owner, defaulted, logger, apply_error)
        new = status.compute_status(owner, defaulted, observation, generation=generation, now=_now(),
                                    previous=previous, service_monitor_state=monitor_state,
                                    inference_pool_state=pool_state, leader_worker_set_state=group_state)
        await _publish_status(body, memo, new, previous, logger)
    operator_metrics.DESIRED_REPLICAS.labels(owner.namespace, owner.name).set(defaulted["replicas"])
    if apply_error:
        raise kopf.TemporaryError(apply_error, delay=30)  # kopf retries; status says why meanwhile


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5)
async def refresh_status(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, logger: kopf.Logger,
                         **_: Any) -> None:
    """Keep status in step with the pods between reconciles (downloads, crashes, readiness)."""
    owner = render.Owner.of(body)
    while not stopped:
        async with _status_lock(memo):
            previous = _last_status(body, memo)
            if "observedGeneration" in previous:  # reconcile has run at least once
                try:
                    spec = crd.with_defaults(dict(body.get("spec") or {}))
                    observation = await _observe(owner, spec, logger, status.carried_apply_error(previous))
                    new = status.compute_status(owner, spec, observation, generation=previous["observedGeneration"],
                                                now=_now(), previous=previous, service_monitor_state=None)
                    await _publish_status(body, memo, new, previous, logger)
                except kube.APIError as exc:
                    operator_metrics.ERRORS.labels("status").inc()
                    logger.warning(f"status refresh failed: {exc}")
        await daemons.pause(stopped, CONFIG.status_interval)


# --- autoscaler: operator/autoscaling/ registers its handlers on import --------------------------------
import pagoda.operator.autoscaling.handlers  # noqa: E402, F401
