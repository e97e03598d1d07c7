"""A stand-in for the Hugging Face Hub (HF_ENDPOINT points at it): the few routes `snapshot_download`
uses, answering as the Hub does — including its error headers (`X-Error-Code`, `X-Error-Message`),
which is how huggingface_hub tells a missing repository from a missing revision or a refused token.

Repositories: `org/model` (public, revision `main`), `org/private` (needs `Authorization: Bearer
good-token`). Any other repository is not found. Every request is recorded in `requests`.
"""

from __future__ import annotations

import hashlib
import json

from aiohttp import web

SHA = "0" * 39 + "1"
GOOD_TOKEN = "good-token"
FILES = {"config.json": json.dumps({"model_type": "llama"}).encode(), "model.safetensors": b"\0" * (1 << 20)}
REPOS = {"org/model": False, "org/private": True}  # name -> needs the token


class HubStub:
    def __init__(self) -> None:
        self.requests: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("GET", "/api/models/{org}/{name}/revision/{revision}", self._info)
        app.router.add_route("GET", "/api/models/{org}/{name}/tree/{revision}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{file}", self._file)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    def _refusal(self, request: web.Request) -> web.Response | None:
        self.requests.append(f"{request.method} {request.path}")
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in REPOS:
            return web.json_response({"error": "Repository not found"}, status=404,
                                     headers={"X-Error-Code": "RepoNotFound"})
        if REPOS[repo] and request.headers.get("Authorization") != f"Bearer {GOOD_TOKEN}":
            message = "Invalid credentials in Authorization header"
            return web.json_response({"error": message}, status=401, headers={"X-Error-Message": message})
        if request.match_info["revision"] not in ("main", SHA):
            return web.json_response({"error": "Invalid rev id"}, status=404,
                                     headers={"X-Error-Code": "RevisionNotFound"})
        return None

    async def _info(self, request: web.Request) -> web.Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response({"id": repo, "sha": SHA, "private": REPOS[repo],
                                  "siblings": [{"rfilename": name} for name in FILES]})

    async def _tree(self, request: web.Request) -> web.Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        return web.json_response([{"type": "file", "path": name, "size": len(body),
                                   "oid": hashlib.sha1(body).hexdigest()} for name, body in FILES.items()])

    async def _file(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._refusal(request)) is not None:
            return refused
        body = FILES.get(request.match_info["file"])
        if body is None:
            return web.json_response({"error": "Entry not found"}, status=404,
                                     headers={"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                   "Content-Length": str(len(body))}
        if request.method == "HEAD":
            return web.Response(headers=headers)
        return web.Response(body=body, headers=headers)
