"""The scaling decision: a pure function mirroring the Kubernetes HPA algorithm.

Source of the maths: kubernetes/pkg/controller/podautoscaler (replica_calculator.go `calcPlainMetricReplicas`
and horizontal.go `stabilizeRecommendationWithBehaviors` / `convertDesiredReplicasWithBehaviorRate`).
Everything the HPA keeps in controller memory (recent recommendations) comes in as `history` and goes
out as `Decision.history`, and the clock comes in as `now`, so the function has no state and no time.

Per metric (a per-pod average with a per-pod target):
  ratio = average over pods with a sample / target
  pods without a sample (not ready, not answering, not yet created) are "missing": when the ratio says
  scale down they count as exactly the target (100 %), when it says scale up as 0 — the HPA's way of
  never scaling on data it does not have; if filling them in flips the direction or lands inside the
  tolerance, the proposal is "keep the current count".
  proposal = ceil(pods × ratio), or the current count when |1 − ratio| ≤ tolerance.
Over metrics: the highest proposal. Then stabilization over the recent (unclamped) recommendations —
scale-down takes the highest of the scale-down window, scale-up the lowest of the scale-up window —
then the scale-up rate limit, then min/max.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagoda.operator import crd

KV_CACHE_USAGE = "kvCacheUsage"
QUEUE_DEPTH = "queueDepth"


@dataclass(frozen=True)
class PodObservation:
    """One pod as the collector saw it. `values` is empty when the pod is not ready or did not answer."""

    name: str
    ready: bool
    values: Mapping[str, float] = field(default_factory=dict)

    def sample(self, metric: str) -> float | None:
        return self.values.get(metric) if self.ready else None


CRD_DEFAULTS = crd.section_defaults("autoscaling")  # a bare Policy() means what an empty spec means


@dataclass(frozen=True)
class Policy:
    """The knobs of `spec.autoscaling`; each default is the CRD schema's (`config.py` maps a spec here)."""

    min_replicas: int = CRD_DEFAULTS["minReplicas"]
    max_replicas: int = 4  # the CRD has no default: it requires maxReplicas when enabled
    targets: Mapping[str, float] = field(default_factory=lambda: {
        KV_CACHE_USAGE: float(CRD_DEFAULTS["targetKVCacheUsage"]), QUEUE_DEPTH: float(CRD_DEFAULTS["targetQueueDepth"])})
    tolerance: float = CRD_DEFAULTS["tolerance"]
    scale_up_stabilization_s: float = CRD_DEFAULTS["scaleUpStabilizationSeconds"]
    scale_down_stabilization_s: float = CRD_DEFAULTS["scaleDownStabilizationSeconds"]
    # Per decision step, the larger of the two limits wins (HPA's default selectPolicy: Max).
    scale_up_max_pods_per_step: int = CRD_DEFAULTS["scaleUpMaxPodsPerStep"]
    scale_up_max_percent_per_step: float = CRD_DEFAULTS["scaleUpMaxPercentPerStep"]


@dataclass(frozen=True)
class Recommendation:
    """An unstabilized recommendation, kept for the stabilization windows."""

    time: float
    replicas: int


@dataclass(frozen=True)
class MetricProposal:
    metric: str
    target: float
    average: float | None  # over the pods that answered
    ratio: float | None  # after filling in missing pods
    pods_with_sample: int
    pods_missing: int
    replicas: int | None  # None: no pod answered, so this metric cannot propose anything
    note: str


@dataclass(frozen=True)
class Decision:
    current_replicas: int
    desired_replicas: int
    recommendation: int | None  # highest proposal over metrics, before stabilization/limits
    metric: str | None  # the metric whose proposal won
    proposals: Mapping[str, MetricProposal]
    reason: str
    history: tuple[Recommendation, ...]

    @property
    def direction(self) -> str:
        if self.desired_replicas > self.current_replicas:
            return "up"
        if self.desired_replicas < self.current_replicas:
            return "down"
        return "none"


def propose(metric: str, target: float, current_replicas: int, pods: Sequence[PodObservation],
            tolerance: float) -> MetricProposal:
    """HPA's `calcPlainMetricReplicas` for one per-pod-average metric."""
    samples = [v for p in pods if (v := p.sample(metric)) is not None]
    # Pods the Deployment should have but that did not answer, including ones not created yet.
    missing = max(current_replicas, len(pods)) - len(samples)
    if not samples:
        return MetricProposal(metric, target, None, None, 0, missing, None, "no pod reported this metric")
    average = sum(samples) / len(samples)
    ratio = average / target

    def replicas_for(r: float, n: int) -> int:
        return math.ceil(r * n - 1e-9)  # float noise (e.g. 3.0000000000000004) must not add a pod

    def result(r: float, replicas: int, note: str) -> MetricProposal:
        return MetricProposal(metric, target, average, r, len(samples), missing, replicas, note)

    if missing == 0:
        if abs(1.0 - ratio) <= tolerance:
            return result(ratio, current_replicas, "within tolerance")
        return result(ratio, replicas_for(ratio, len(samples)), "ceil(pods × average / target)")
    filled = target if ratio < 1.0 else 0.0
    new_ratio = (sum(samples) + filled * missing) / (target * (len(samples) + missing))
    if abs(1.0 - new_ratio) <= tolerance or (ratio < 1.0) != (new_ratio < 1.0):
        return result(new_ratio, current_replicas, f"{missing} missing pod(s): change too small or unsure")
    replicas = replicas_for(new_ratio, len(samples) + missing)
    if (new_ratio < 1.0 and replicas > current_replicas) or (new_ratio > 1.0 and replicas < current_replicas):
        return result(new_ratio, current_replicas, f"{missing} missing pod(s): direction unsure")
    side = "100 % of target" if ratio < 1.0 else "0"
    return result(new_ratio, replicas, f"{missing} missing pod(s) counted as {side}")


def stabilize(current: int, recommendation: int, history: Sequence[Recommendation], now: float,
              policy: Policy) -> tuple[int, tuple[Recommendation, ...]]:
    """HPA's `stabilizeRecommendationWithBehaviors`: returns the stabilized count and the new history."""
    up_cutoff = now - policy.scale_up_stabilization_s
    down_cutoff = now - policy.scale_down_stabilization_s
    up, down = recommendation, recommendation
    for rec in history:
        if rec.time > up_cutoff:
            up = min(up, rec.replicas)
        if rec.time > down_cutoff:
            down = max(down, rec.replicas)
    stabilized = min(max(current, up), down)
    oldest_needed = min(up_cutoff, down_cutoff)
    kept = [r for r in history if r.time > oldest_needed]
    return stabilized, compact((*kept, Recommendation(now, recommendation)))


def compact(history: Sequence[Recommendation]) -> tuple[Recommendation, ...]:
    """Drop the recommendations no window can ever pick again, so the history (mirrored in status)
    stays as small as the number of distinct values, however short the interval and long the window.

    The windows are suffixes in time, so an entry followed by a newer one at least as high never sets
    a window's maximum, and one followed by a newer one at most as low never sets its minimum; an entry
    with both is dead (e.g. every repeat of a steady recommendation but the newest)."""
    kept: list[Recommendation] = []
    newer_max, newer_min = -1, None
    for rec in reversed(history):
        if rec.replicas > newer_max or newer_min is None or rec.replicas < newer_min:
            kept.append(rec)
        newer_max = max(newer_max, rec.replicas)
        newer_min = rec.replicas if newer_min is None else min(newer_min, rec.replicas)
    return tuple(reversed(kept))


def scale_up_limit(current: int, policy: Policy) -> int:
    by_pods = current + policy.scale_up_max_pods_per_step
    by_percent = math.ceil(current * (1.0 + policy.scale_up_max_percent_per_step / 100.0))
    return max(by_pods, by_percent)


def decide(current_replicas: int, pods: Sequence[PodObservation], policy: Policy,
           history: Sequence[Recommendation], now: float) -> Decision:
    """The replica count the InferenceService should have now, and why."""
    proposals = {m: propose(m, t, current_replicas, pods, policy.tolerance) for m, t in policy.targets.items()}

    def decision(desired: int, recommendation: int | None, metric: str | None, reason: str,
                 new_history: Sequence[Recommendation] = tuple(history)) -> Decision:
        return Decision(current_replicas, desired, recommendation, metric, proposals, reason, tuple(new_history))

    if current_replicas == 0:
        return decision(0, None, None, "scaled to zero by hand: autoscaling paused until replicas > 0")
    if current_replicas > policy.max_replicas:
        return decision(policy.max_replicas, None, None, f"above maxReplicas {policy.max_replicas}")
    if current_replicas < policy.min_replicas:
        return decision(policy.min_replicas, None, None, f"below minReplicas {policy.min_replicas}")

    valid = {m: p.replicas for m, p in proposals.items() if p.replicas is not None}
    if not valid:
        return decision(current_replicas, None, None, "no metrics from any pod: keeping the current count")
    metric = max(valid, key=lambda m: valid[m])
    recommendation = valid[metric]
    if len(valid) < len(proposals) and recommendation < current_replicas:
        # A metric we cannot read might want more pods: never scale down on half the picture (as HPA).
        return decision(current_replicas, recommendation, metric,
                        "some metrics missing: not scaling down on the others")

    stabilized, new_history = stabilize(current_replicas, recommendation, history, now, policy)
    reason = f"{metric} proposes {recommendation} ({proposals[metric].note})"
    if stabilized != recommendation:
        if recommendation < current_replicas:
            window = policy.scale_down_stabilization_s
            reason += f"; scale-down stabilized to {stabilized}, the highest recommendation in {window:g} s"
        else:
            window = policy.scale_up_stabilization_s
            reason += f"; scale-up stabilized to {stabilized}, the lowest recommendation in {window:g} s"

    desired = stabilized
    if desired > current_replicas:
        limit = max(scale_up_limit(current_replicas, policy), current_replicas)
        if desired > min(limit, policy.max_replicas):
            if limit < policy.max_replicas:
                reason += f"; scale-up rate limit {limit}"
            else:
                reason += f"; clamped to maxReplicas {policy.max_replicas}"
            desired = min(limit, policy.max_replicas)
    elif desired < current_replicas and desired < policy.min_replicas:
        reason += f"; clamped to minReplicas {policy.min_replicas}"
        desired = policy.min_replicas
    return decision(desired, recommendation, metric, reason, new_history)
