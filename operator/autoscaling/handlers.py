"""The autoscaler's kopf handler: per InferenceService, every `intervalSeconds`, collect → decide → act.

A daemon rather than a `kopf.timer`: a timer's interval is fixed at import, while `intervalSeconds`
is per object and may change (the daemon's `spec` is a live view, re-read every round).

Each round: read the scale subresource (current replicas, pod selector); list the pods; scrape the
ready ones (or query Prometheus); write `status.kvCache` (always, even with autoscaling disabled);
when enabled, decide (pure HPA maths), write `spec.replicas` through the scale subresource if it
changes, post an Event, and record the decision in `status.autoscaling`. Disabled autoscaling never
touches `spec.replicas`, so users, HPA or KEDA can own it. `pagoda operator --no-autoscaler` disables
it for every InferenceService whatever its spec says (an external autoscaler owns every replica
count; a Warning Event tells objects that ask for the built-in one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import aiohttp
import kopf
from pagoda.operator import crd, daemons, operator_metrics
from pagoda.operator.autoscaling import kube, scale_status
from pagoda.operator.autoscaling.collect import PodSample, query_prometheus, scrape_pods
from pagoda.operator.autoscaling.config import Collection, collection_from_spec, policy_from_spec
from pagoda.operator.autoscaling.decision import PodObservation, Recommendation, decide
from pagoda.operator.autoscaling.pods import is_ready, live_pods, scrape_target

HISTORY_MEMO_KEY = "autoscaler_history"
WARNED_MEMO_KEY = "autoscaler_off_warned"
SOURCE_DOWN_MEMO_KEY = "autoscaler_source_down_since"


class Switch:
    """Operator-wide: False (`--no-autoscaler`) means never write spec.replicas, whatever the spec asks."""

    enabled = True


SWITCH = Switch()

_clock_anchors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[float, float]] = (
    weakref.WeakKeyDictionary())


def wall_clock() -> float:
    """Wall-clock seconds that advance with the event loop's clock (anchored once per loop).

    Monotonic in production (no jumps when the node's clock is corrected), and in tests it follows
    looptime's fake clock, so stabilization windows of minutes take no real time.
    """
    loop = asyncio.get_running_loop()
    if loop not in _clock_anchors:
        _clock_anchors[loop] = (time.time(), loop.time())
    wall, at = _clock_anchors[loop]
    return wall + loop.time() - at


async def collect(collection: Collection, namespace: str,
                  ready_pods: list[Mapping[str, Any]]) -> dict[str, PodSample | str]:
    if collection.prometheus_url:
        names = [p["metadata"]["name"] for p in ready_pods]
        # Series older than two intervals (at least 30 s) are stale: those pods count as missing.
        return await query_prometheus(collection.prometheus_url, namespace, names,
                                      timeout=collection.scrape_timeout_s,
                                      max_age_s=max(2 * collection.interval_s, 30.0))
    return await scrape_pods([scrape_target(p) for p in ready_pods], timeout=collection.scrape_timeout_s)


def source_failure(collection: Collection, samples: Mapping[str, PodSample | str]) -> str | None:
    """Why the metrics source as a whole did not answer (Prometheus down), or None. Per-pod scrape
    failures are not this: those pods count as missing, the others still decide."""
    errors = list(samples.values())
    if collection.prometheus_url and errors and all(isinstance(e, str) and e.startswith("prometheus:")
                                                    for e in errors):
        return errors[0]
    return None


def report_source(failure: str | None, memo: MutableMapping[str, Any], body: Any, now: float) -> None:
    """One Warning Event when the metrics source goes away, one Normal Event when it is back."""
    down_since = memo.get(SOURCE_DOWN_MEMO_KEY)
    if failure and down_since is None:
        memo[SOURCE_DOWN_MEMO_KEY] = now
        kopf.event(body, type="Warning", reason="MetricsUnavailable",
                   message=f"holding spec.replicas until the metrics source answers: {failure}"[:1000])
    elif not failure and down_since is not None:
        del memo[SOURCE_DOWN_MEMO_KEY]
        kopf.event(body, type="Normal", reason="MetricsAvailable",
                   message=f"the metrics source answers again after {now - down_since:.0f} s; scaling resumes")


def known_history(memo: MutableMapping[str, Any], status: Mapping[str, Any], current: int,
                  now: float) -> tuple[Recommendation, ...]:
    """Recent recommendations: from memory; after a (re)start, those mirrored in status plus the current
    count as if just recommended. An operator saw nothing while it was down: like a missing metric (the
    HPA's rule), that gap never argues for fewer pods, so a restarted or fresh operator scales down only
    after one full window of its own readings, and never below what the mirrored window still holds."""
    if HISTORY_MEMO_KEY in memo:
        return memo[HISTORY_MEMO_KEY]
    return (*scale_status.history_from_status(status.get("autoscaling")), Recommendation(now, current))


async def autoscale_once(namespace: str, name: str, spec: Mapping[str, Any], status: Mapping[str, Any],
                         memo: MutableMapping[str, Any], body: Any, logger: Any) -> None:
    autoscaling = spec.get("autoscaling") or {}
    scale = await kube.get_scale(namespace, name, logger)
    selector = (scale.get("status") or {}).get("selector")
    if not selector:
        logger.debug("autoscaler: no pod selector in status yet; waiting for the first reconcile")
        return
    current = int((scale.get("spec") or {}).get("replicas") or 0)
    pods = live_pods(await kube.list_pods(namespace, selector, logger))
    ready = [p for p in pods if is_ready(p)]
    not_ready = [p["metadata"]["name"] for p in pods if not is_ready(p)]
    collection = collection_from_spec(autoscaling)
    samples = await collect(collection, namespace, ready)
    now = wall_clock()
    failure = source_failure(collection, samples)

    status_patch: dict[str, Any] = {}
    if (kv_cache := scale_status.kv_cache_status(samples, now)) is not None:
        status_patch["kvCache"] = kv_cache
    if autoscaling.get("enabled") and not SWITCH.enabled and not memo.get(WARNED_MEMO_KEY):
        memo[WARNED_MEMO_KEY] = True
        kopf.event(body, type="Warning", reason="AutoscalerOff",
                   message="spec.autoscaling.enabled is ignored: the operator runs with --no-autoscaler "
                           "(an external autoscaler such as KEDA or an HPA owns spec.replicas)")
    if autoscaling.get("enabled") and SWITCH.enabled:
        observations = [PodObservation(n, True, s.values() if isinstance(s, PodSample) else {})
                        for n, s in samples.items()] + [PodObservation(n, False) for n in not_ready]
        history = known_history(memo, status, current, now)
        decision = decide(current, observations, policy_from_spec(autoscaling), history, now)
        if failure:  # no data is not zero load: hold (decide keeps the count when no pod has a sample)
            decision = dataclasses.replace(
                decision, reason=f"metrics source unavailable, holding {current} replicas: {failure}"[:1000])
        report_source(failure, memo, body, now)
        memo[HISTORY_MEMO_KEY] = decision.history
        scaled_at = None
        if decision.direction != "none":
            await kube.set_replicas(namespace, name, decision.desired_replicas, logger)
            scaled_at = now
            message = f"{current} → {decision.desired_replicas}: {decision.reason}"
            logger.info(f"autoscaler: {message}")
            # kopf.event, not kopf.info: the operator posts only WARNING+ of kopf's own chatter.
            kopf.event(body, type="Normal", reason="Scaled" + decision.direction.capitalize(),
                       message=message[:1000])
            operator_metrics.SCALE_DECISIONS.labels(namespace, name, decision.direction).inc()
        status_patch["autoscaling"] = scale_status.autoscaling_status(
            decision, samples, not_ready, status.get("autoscaling"), scaled_at)
    elif status.get("autoscaling") is not None:
        # Switched off: a stale decision in status would mislead; re-enabling starts a fresh window.
        status_patch["autoscaling"] = None
        memo.pop(HISTORY_MEMO_KEY, None)
    if status_patch:
        await kube.patch_status(namespace, name, status_patch, logger)


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, cancellation_timeout=10.0)
async def autoscaler(stopped: kopf.DaemonStopped, name: str, namespace: str, spec: Mapping[str, Any],
                     status: Mapping[str, Any], memo: MutableMapping[str, Any], body: Any, logger: Any,
                     **_: Any) -> None:
    while not stopped:
        try:
            await autoscale_once(namespace, name, spec, status, memo, body, logger)
        except kube.NotFound:
            logger.debug("autoscaler: the InferenceService is gone")
        except (kube.APIError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # A missed round is harmless: the next one starts from fresh observations.
            operator_metrics.ERRORS.labels("autoscale").inc()
            logger.warning(f"autoscaler: round skipped: {exc!r}")
        await daemons.pause(stopped, collection_from_spec(spec.get("autoscaling")).interval_s)
