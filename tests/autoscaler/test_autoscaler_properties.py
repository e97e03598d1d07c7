"""Properties of the scaling decision over thousands of random situations (pure function, no clock).

The table tests pin the HPA maths case by case; these check what must hold everywhere: bounds, the
scale-up rate limit, no move inside the tolerance, and that more load never asks for fewer pods.
"""

from __future__ import annotations

import random

from pagoda.operator.autoscaling.decision import (
    KV_CACHE_USAGE,
    QUEUE_DEPTH,
    PodObservation,
    Policy,
    Recommendation,
    decide,
    scale_up_limit,
)

NOW = 10_000.0


def random_policy(rng: random.Random) -> Policy:
    low = rng.randint(1, 4)
    return Policy(
        min_replicas=low,
        max_replicas=rng.randint(low, 12),
        targets={KV_CACHE_USAGE: rng.choice([0.5, 0.7, 0.9]), QUEUE_DEPTH: rng.choice([1.0, 4.0, 8.0])},
        tolerance=rng.choice([0.0, 0.1, 0.2]),
        scale_up_stabilization_s=rng.choice([0.0, 30.0]),
        scale_down_stabilization_s=rng.choice([0.0, 300.0]),
        scale_up_max_pods_per_step=rng.randint(1, 4),
        scale_up_max_percent_per_step=rng.choice([0.0, 50.0, 100.0]),
    )


def random_pods(rng: random.Random, count: int) -> list[PodObservation]:
    pods = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.1:
            pods.append(PodObservation(f"p{i}", False, {KV_CACHE_USAGE: 1.0, QUEUE_DEPTH: 99.0}))
        elif roll < 0.2:
            pods.append(PodObservation(f"p{i}", True, {}))  # ready but did not answer
        else:
            values = {KV_CACHE_USAGE: rng.uniform(0, 1), QUEUE_DEPTH: rng.choice([0.0, rng.uniform(0, 30)])}
            pods.append(PodObservation(f"p{i}", True, values))
    return pods


def random_history(rng: random.Random) -> list[Recommendation]:
    times = sorted(NOW - rng.uniform(1, 600) for _ in range(rng.randint(0, 5)))
    return [Recommendation(t, rng.randint(1, 12)) for t in times]


def test_bounds_and_scale_up_rate_hold_everywhere():
    rng = random.Random(1)
    for _ in range(5000):
        policy = random_policy(rng)
        current = rng.randint(0, 14)
        pods = random_pods(rng, rng.randint(0, current + 2))
        decision = decide(current, pods, policy, random_history(rng), NOW)
        desired = decision.desired_replicas
        if current == 0:
            assert desired == 0  # scaled to zero by hand: left alone
            continue
        assert policy.min_replicas <= desired <= policy.max_replicas, decision
        if policy.min_replicas <= current <= policy.max_replicas:
            assert desired <= max(current, scale_up_limit(current, policy)), decision
        assert decision.reason


def test_inside_the_tolerance_nothing_moves():
    rng = random.Random(2)
    for _ in range(2000):
        policy = random_policy(rng)
        current = rng.randint(policy.min_replicas, policy.max_replicas)
        band = policy.tolerance * 0.99
        pods = [
            PodObservation(
                f"p{i}", True, {m: t * rng.uniform(1 - band, 1 + band) for m, t in policy.targets.items()}
            )
            for i in range(current)
        ]
        # Averages inside the band, every pod answering, no history: the count stays.
        assert decide(current, pods, policy, [], NOW).desired_replicas == current


def test_more_load_never_asks_for_fewer_pods():
    rng = random.Random(3)
    for _ in range(3000):
        policy = random_policy(rng)
        current = rng.randint(policy.min_replicas, policy.max_replicas)
        pods = random_pods(rng, current)
        history = random_history(rng)
        before = decide(current, pods, policy, history, NOW)
        hotter = [
            PodObservation(
                p.name, p.ready, {m: v * rng.uniform(1, 3) + rng.uniform(0, 0.2) for m, v in p.values.items()}
            )
            for p in pods
        ]
        after = decide(current, hotter, policy, history, NOW)
        assert after.desired_replicas >= before.desired_replicas, (before, after)
