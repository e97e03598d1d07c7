"""Autoscaler fixtures (stand-in pods: see support/autoscaler_pods.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from support.autoscaler_pods import FakePodFarm


@pytest.fixture
async def fake_pods() -> AsyncIterator[FakePodFarm]:
    farm = FakePodFarm()
    yield farm
    await farm.close()
