"""The scaling decision as a table (HPA maths), with an injected clock: windows of minutes take no time."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from pagoda.operator.autoscaling.decision import (
    KV_CACHE_USAGE,
    QUEUE_DEPTH,
    PodObservation,
    Policy,
    Recommendation,
    decide,
)

POLICY = Policy(min_replicas=1, max_replicas=8)  # every other knob: the CRD's defaults


def test_the_cases_below_assume_the_crd_defaults() -> None:
    """The expected replica counts are worked out for these values; a changed default fails here first."""
    assert (POLICY.targets, POLICY.tolerance, POLICY.scale_down_stabilization_s) == (
        {KV_CACHE_USAGE: 0.7, QUEUE_DEPTH: 4.0}, 0.1, 300)


def pods(*samples: tuple[float, float] | None) -> list[PodObservation]:
    """One pod per argument: (kv usage, waiting) or None for a ready pod that did not answer."""
    return [
        PodObservation(f"p{i}", True, {} if s is None else {KV_CACHE_USAGE: s[0], QUEUE_DEPTH: s[1]})
        for i, s in enumerate(samples)
    ]


def not_ready(name: str) -> PodObservation:
    return PodObservation(name, False, {KV_CACHE_USAGE: 0.99, QUEUE_DEPTH: 50})  # values must be ignored


@dataclass
class Case:
    id: str
    current: int
    pods: list[PodObservation]
    desired: int
    metric: str | None = None
    policy: Policy = POLICY
    history: list[Recommendation] = field(default_factory=list)
    reason_has: str = ""


CASES = [
    Case("steady inside tolerance", 2, pods((0.72, 4.2), (0.66, 3.8)), 2, reason_has="within tolerance"),
    Case("kv at 2x target doubles", 2, pods((1.4, 0), (1.4, 0)), 4, KV_CACHE_USAGE),
    Case(
        "kv at 2x target doubles within max",
        3,
        pods((1.4, 0), (1.4, 0), (1.4, 0)),
        4,
        KV_CACHE_USAGE,
        policy=Policy(max_replicas=4),
        reason_has="maxReplicas 4",
    ),
    Case("queue spike with low kv scales on queue", 1, pods((0.2, 12)), 3, QUEUE_DEPTH),
    Case("max over metrics", 2, pods((1.05, 10), (1.05, 10)), 5, QUEUE_DEPTH),
    Case(
        "clamped to min",
        3,
        pods((0.0, 0), (0.0, 0), (0.0, 0)),
        2,
        policy=Policy(min_replicas=2),
        reason_has="minReplicas 2",
    ),
    Case("current above max goes to max", 9, pods((0.7, 4)), 8, reason_has="above maxReplicas"),
    Case("current below min goes to min", 1, pods((0.1, 0)), 2, policy=Policy(min_replicas=2)),
    Case(
        "scale-up rate limit per step",
        2,
        pods((7.0, 0), (7.0, 0)),
        6,
        KV_CACHE_USAGE,
        policy=Policy(max_replicas=50, scale_up_max_pods_per_step=4, scale_up_max_percent_per_step=100),
        reason_has="rate limit 6",
    ),
    # Missing pods (HPA): on scale-up they count as 0, on scale-down as 100 % of target.
    Case(
        "scale-up: missing pod counts as 0",
        2,
        pods((0.1, 12), None),
        3,
        QUEUE_DEPTH,
        reason_has="counted as 0",
    ),
    Case("scale-up: not-ready pod counts as 0", 2, [*pods((0.1, 12)), not_ready("p9")], 3, QUEUE_DEPTH),
    Case("scale-up: missing flips direction, keep", 2, pods((0.9, 0), None), 2),
    Case(
        "scale-down: missing pods count as 100%",
        4,
        pods((0.0, 0), (0.0, 0), None, None),
        2,
        history=[],
        policy=Policy(scale_down_stabilization_s=0),
        reason_has="100 % of target",
    ),
    Case("pods not created yet count as missing", 3, pods((2.8, 0)), 4, KV_CACHE_USAGE),
    Case("no pod answers: keep", 3, pods(None, None, None), 3, reason_has="no metrics"),
    Case("all pods not ready: keep", 2, [not_ready("a"), not_ready("b")], 2, reason_has="no metrics"),
    Case(
        "one metric missing: no scale-down on the other",
        2,
        [PodObservation("a", True, {KV_CACHE_USAGE: 0.0}), PodObservation("b", True, {KV_CACHE_USAGE: 0.0})],
        2,
        policy=Policy(scale_down_stabilization_s=0),
        reason_has="some metrics missing",
    ),
    Case(
        "one metric missing: scale-up on the other",
        1,
        [PodObservation("a", True, {KV_CACHE_USAGE: 1.4})],
        2,
        KV_CACHE_USAGE,
    ),
    Case("replicas 0 by hand: paused", 0, [], 0, reason_has="paused"),
    Case(
        "scale-up stabilization takes the lowest in window",
        2,
        pods((1.4, 0), (1.4, 0)),
        3,
        policy=Policy(scale_up_stabilization_s=60),
        history=[Recommendation(950.0, 3)],
        reason_has="scale-up stabilized to 3",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decision_table(case: Case) -> None:
    d = decide(case.current, case.pods, case.policy, case.history, now=1000.0)
    assert d.desired_replicas == case.desired, d.reason
    if case.metric:
        assert d.metric == case.metric, d.reason
    assert case.reason_has in d.reason


def test_proposal_is_ceil_of_replicas_times_ratio() -> None:
    d = decide(3, pods((0.9, 1), (0.8, 2), (0.7, 3)), POLICY, [], now=0.0)
    kv = d.proposals[KV_CACHE_USAGE]
    assert kv.average == pytest.approx(0.8)
    assert kv.replicas == 4  # ceil(3 × 0.8 / 0.7) = ceil(3.43)
    assert d.proposals[QUEUE_DEPTH].replicas == 2  # ceil(3 × 2 / 4) = ceil(1.5)
    assert d.desired_replicas == 4 and d.direction == "up"


def test_load_drop_waits_for_the_window_then_takes_the_highest_recommendation() -> None:
    """A 300 s scale-down window walked through with an injected clock, 15 s per decision."""
    policy = Policy(min_replicas=1, max_replicas=8, scale_down_stabilization_s=300)
    history: tuple[Recommendation, ...] = ()
    t = 0.0
    # Under load at 4 replicas: recommendation 4 at t=0.
    d = decide(4, pods((0.7, 4), (0.7, 4), (0.7, 4), (0.7, 4)), policy, history, t)
    assert d.desired_replicas == 4
    history = d.history
    # Load falls to a level worth 3 replicas for a minute, then to nothing.
    seen = []
    for step in range(1, 40):
        t = 15.0 * step
        load = (0.5, 2) if t <= 60 else (0.0, 0)
        d = decide(4, pods(*[load] * 4), policy, history, t)
        history = d.history
        seen.append((t, d.desired_replicas))
    by_time = dict(seen)
    # Inside the window of the t=0 recommendation (4): nothing moves.
    assert all(r == 4 for tt, r in seen if tt < 300), seen
    # At t=300 the 4 has left the window; the highest left is the 3 of t=15..60.
    assert by_time[300.0] == 3
    # Once t=60 (the last 3) leaves the window at t=360, the floor is the min.
    assert by_time[345.0] == 3 and by_time[360.0] == 1
    # History only keeps what the window needs.
    assert all(r.time > t - 300 for r in history)


def test_no_flapping_under_oscillating_load() -> None:
    """Demand swinging every interval must scale up once and never flap down within the window."""
    history: tuple[Recommendation, ...] = ()
    replicas = 2
    changes = 0
    for step in range(40):
        demand = 2.0 if step % 2 == 0 else 0.6  # KV demand in whole pods, spread over the replicas
        load = (demand / replicas, 0)
        d = decide(replicas, pods(*[load] * replicas), POLICY, history, 15.0 * step)
        history = d.history
        if d.desired_replicas != replicas:
            changes += 1
        replicas = d.desired_replicas
    assert replicas == 3  # ceil(2 × 1.0 / 0.7); at 3 the peak is inside tolerance, the troughs are stabilized
    assert changes == 1


def test_compacted_history_decides_exactly_as_the_full_one_and_stays_small() -> None:
    """A 1 s interval under busy and quiet phases with noise: the mirrored history stays a handful of
    entries, and every decision equals the one made with the complete history of the windows."""
    policy = Policy(
        min_replicas=1, max_replicas=8, scale_down_stabilization_s=120, scale_up_stabilization_s=30
    )
    compacted: tuple[Recommendation, ...] = ()
    full: list[Recommendation] = []
    replicas, changes, recommended = 2, 0, set()
    for step in range(1800):
        noise = ((step * 7919) % 101) / 100  # deterministic
        demand = (0.5 + 5 * noise) if (step // 200) % 2 else 0.3 * noise  # KV demand in whole pods
        pods_now = pods(*[(min(1.0, demand / replicas), 0)] * replicas)
        d = decide(replicas, pods_now, policy, compacted, float(step))
        reference = decide(replicas, pods_now, policy, full, float(step))
        assert d.desired_replicas == reference.desired_replicas, step
        compacted = d.history
        full = [r for r in full if r.time > step - 120] + [Recommendation(float(step), d.recommendation or 0)]
        changes += d.desired_replicas != replicas
        recommended.add(d.recommendation)
        replicas = d.desired_replicas
    assert changes >= 6 and len(recommended) >= 3  # the load really moved the replicas up and down
    assert len(full) == 120 and len(compacted) <= 6, len(compacted)
