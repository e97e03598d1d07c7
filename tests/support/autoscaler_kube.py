"""The kube emulator as the autoscaler tests use it."""

from __future__ import annotations

from typing import Any

import aiohttp.web
import jsonpatch
import kmock

from support.kube_emulator import KubeEmulator


class ConflictingKubeEmulator(KubeEmulator):
    """The shared emulator, plus the API server's answer to a JSON patch whose `test` op fails:
    422 (kopf then retries on its next cycle), not the 500 kmock gives any exception (kopf would
    retry the same stale patch until it gives up). Drop this once support/kube_emulator.py does it."""

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise kmock.KubernetesError(422, "Invalid", f"the object has been modified: {exc}") from exc
