"""The `model-download` init container: put an hf:// model into the weight volume once, or say why not.

    python -m pagoda.server.model_download      (configured by the environment the operator renders)

PAGODA_MODEL is the target folder, HF_REPO_ID / HF_REVISION what to fetch, HF_TOKEN (optional) the
token, HF_ENDPOINT (optional) the hub. The completion marker is checked first (present: the model is
complete, the hub is not asked) and written last, by an atomic rename after every file is in place,
so an interrupted or failed download is never taken for a complete model; the next start resumes it.

A failure exits 1 with one last line on stderr, `model download failed: <cause>: <detail>`. The pod
spec sets `terminationMessagePolicy: FallbackToLogsOnError`, so the kubelet reports that line as the
container's termination message, and the operator carries it into the InferenceService's Degraded
condition (reason ModelDownloadFailed).
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

MARKER = ".pagoda-download-complete"  # the operator reads it from here (weights.DOWNLOAD_MARKER)
FAILURE_PREFIX = "model download failed: "


def is_complete(target: Path) -> bool:
    return (target / MARKER).is_file()


def mark_complete(target: Path, revision: str) -> None:
    scratch = target / f"{MARKER}.tmp"
    scratch.write_text(revision)
    os.replace(scratch, target / MARKER)  # atomic: the marker is either absent or whole


def explain(exc: BaseException, repo_id: str, revision: str) -> str:
    """`<cause>: <detail>` for a person to act on."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ("disk full: the weight volume ran out of space; raise spec.storage.size "
                "(a new PVC size needs a new claim)")
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError, its base class
        return (f"access refused: {repo_id} is gated and the token has not been granted access "
                "(accept its terms on the hub, or use another token in spec.model.hfTokenSecretRef)")
    if isinstance(exc, RevisionNotFoundError):
        return f"revision not found: {revision!r} is not a branch, tag or commit of {repo_id}"
    if isinstance(exc, RepositoryNotFoundError):
        return (f"repository not found: {repo_id} does not exist, or is private and needs a token "
                "(spec.model.hfTokenSecretRef)")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return (f"token refused: the hub answered {exc.response.status_code} for the token in "
                "spec.model.hfTokenSecretRef (expired, revoked or mistyped)")
    if isinstance(exc, LocalEntryNotFoundError):
        return f"the hub did not answer as expected: {exc.__cause__ or exc}"
    return f"{type(exc).__name__}: {exc}"


def download(target: Path, repo_id: str, revision: str, token: str | None) -> None:
    from huggingface_hub import snapshot_download

    target.mkdir(parents=True, exist_ok=True)
    snapshot_download(repo_id=repo_id, revision=revision, local_dir=target, token=token)
    mark_complete(target, revision)


def main() -> int:
    target = Path(os.environ["PAGODA_MODEL"])
    repo_id, revision = os.environ["HF_REPO_ID"], os.environ.get("HF_REVISION") or "main"
    if is_complete(target):
        print(f"model already present in {target}, skipping download", flush=True)
        return 0
    try:
        download(target, repo_id, revision, os.environ.get("HF_TOKEN") or None)
    except Exception as exc:
        print(f"{FAILURE_PREFIX}{explain(exc, repo_id, revision)}", file=sys.stderr, flush=True)
        return 1
    print(f"downloaded {repo_id}@{revision} into {target}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
