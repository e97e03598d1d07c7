"""The aiohttp application: routes, API-key check, and OpenAI error bodies for every failure."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pagoda.server.api.chat import create_chat_completion
from pagoda.server.api.completions import create_completion
from pagoda.server.api.kv import add_routes as add_kv_routes
from pagoda.server.api.state import ServerState
from pagoda.server.protocol import APIError, bad_request
from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)
STATE = web.AppKey("state", ServerState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: APIError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as OpenAI's error JSON; unexpected ones are logged, never crash the loop."""
    try:
        return await handler(request)
    except APIError as error:
        return error_response(error)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(APIError(413, f"Request body too large: {exc.text}", code="request_too_large"))
    except web.HTTPException as exc:  # routing: 404 unknown path, 405 wrong method
        if exc.status < 400:
            raise
        return error_response(APIError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(APIError(500, "Internal server error", type="internal_error"))


KV_KEY_COOKIE = "pagoda_api_key"


def _is_kv_view(path: str) -> bool:
    return path == "/kv" or path.startswith("/kv/")


def _given_key(request: web.Request) -> str:
    """The bearer token; for the /kv views also the cookie or `?api_key=` (a browser opening the page
    and its EventSource cannot send headers)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    if _is_kv_view(request.path):
        return request.query.get("api_key") or request.cookies.get(KV_KEY_COOKIE, "")
    return ""


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With --api-key, every /v1 call and the /kv views need the key; probes and scrapes stay open."""
    api_key = request.app[STATE].config.api_key
    if api_key and (request.path.startswith("/v1") or _is_kv_view(request.path)):
        if not hmac.compare_digest(_given_key(request).encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
        response = await handler(request)
        if request.path == "/kv" and "api_key" in request.query:  # the page's own requests send it back
            response.set_cookie(KV_KEY_COOKIE, api_key, path="/kv", httponly=True, samesite="Strict")
        return response
    return await handler(request)


async def read_json(request: web.Request) -> Any:
    raw = await request.read()  # aiohttp raises 413 beyond client_max_size
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise bad_request("We could not parse the JSON body of your request.", code="invalid_json") from None


async def completions(request: web.Request) -> web.StreamResponse:
    return await create_completion(request, request.app[STATE], await read_json(request))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await create_chat_completion(request, request.app[STATE], await read_json(request))


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    card: dict[str, Any] = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "pagoda",
    }
    if engine is not None:
        card["max_model_len"] = engine.max_model_len
    return card


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(state)] if state.engine else []})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_model(request.match_info["model"])
    if state.engine is None:
        raise APIError(503, "The model is still loading.", type="service_unavailable", code="loading")
    return web.json_response(_model_card(state))


async def health(request: web.Request) -> web.Response:
    alive, why = request.app[STATE].health()
    return web.json_response({"status": why}, status=200 if alive else 503)


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready:
        return web.json_response({"status": "ready"})
    why = "draining" if state.draining else "loading"
    return web.json_response({"status": why}, status=503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = state.metrics.exposition() if state.metrics else b""
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware], client_max_size=state.config.max_request_body_bytes
    )
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)  # ids may hold a slash: org/name
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    add_kv_routes(app, STATE)
    return app
