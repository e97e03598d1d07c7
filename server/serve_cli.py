"""`pagoda serve`: the OpenAI-compatible server of one pod (flags or PAGODA_* environment variables)."""

from __future__ import annotations

import argparse
import os

HELP = "serve a model over an OpenAI-compatible HTTP API with Prometheus metrics"
ENV_PREFIX = "PAGODA_"


def _env(flag: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagoda.server.engine.config import EngineArgs, env_bool, parse_bytes

    group = parser.add_argument_group("server")

    def add(flag: str, **kw) -> None:
        group.add_argument(f"--{flag}", default=_env(flag, kw.pop("default", None)), **kw)

    # 0.0.0.0: in a pod the kubelet probes and the Service reach the pod IP, not loopback.
    add("host", default="0.0.0.0", help="address to listen on (default 0.0.0.0; use 127.0.0.1 locally)")
    add("port", type=int, default=8000, help="port to listen on")
    add("served-model-name", help="model name clients send and metrics carry (default: the model's)")
    add("api-key", help="require `Authorization: Bearer KEY` on /v1 (probes and /metrics stay open)")
    add("max-queue-len", type=int, help="answer 429 when this many requests already wait (default: no limit)")
    add("max-request-body-bytes", type=parse_bytes, default=4 << 20, help="413 above this body size")
    add("drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    add("log-level", default="info", help="debug, info, warning, error")
    add("kv-usage-target", type=float, default=0.7,
        help="the autoscaler's KV-cache usage target, shown on the /kv page (default 0.7)")  # fmt: skip
    group.add_argument(
        "--vllm-compatible-metrics",
        action=argparse.BooleanOptionalAction,
        default=env_bool(_env("vllm-compatible-metrics"), False),
        help="also export /metrics under vLLM's names (vllm:*), for tools written for vLLM",
    )
    EngineArgs.add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pagoda.server.api.state import ServerConfig
    from pagoda.server.engine.config import EngineArgs

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ServerConfig(
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_queue_len=args.max_queue_len,
        max_request_body_bytes=args.max_request_body_bytes,
        drain_timeout=args.drain_timeout,
        kv_usage_target=args.kv_usage_target,
        vllm_compatible_metrics=args.vllm_compatible_metrics,
    )
    return asyncio.run(_serve(config, EngineArgs.from_cli_args(args), args.host, args.port))


ENGINE_DEATH_LINGER_S = 1.0  # after the engine loop died: /health and /ready answer 503, then exit 1


async def _serve(config, engine_args, host: str, port: int) -> int:
    import asyncio
    import logging
    import signal

    from pagoda.server.api.lifecycle import PagodaServer

    log = logging.getLogger("pagoda.serve")
    server = PagodaServer(config, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    loading = asyncio.create_task(server.load(engine_args))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        log.error("model failed to load: %s", loading.exception())
        stopping.cancel()
        await server.drain_and_stop(timeout=0)
        return 1
    if loading.done():
        # A dead engine loop cannot recover in this process: exit non-zero so the kubelet restarts
        # the container (its consumers already got their errors; /health already says 503).
        died = asyncio.create_task(server.state.engine.wait_dead())
        await asyncio.wait({died, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if died.done():
            log.error("engine loop died: %r; exiting 1", died.result())
            stopping.cancel()
            # The error bodies go out, and probes and endpoints see 503 before the port closes.
            await asyncio.sleep(ENGINE_DEATH_LINGER_S)
            await server.drain_and_stop(timeout=0)
            return 1
        died.cancel()
    await stopping
    if not loading.done():  # stopped while loading: nothing in flight, wait for the load to end
        await asyncio.gather(loading, return_exceptions=True)
    drained = await server.drain_and_stop()
    log.info("stopped (%s)", "drained" if drained else "drain timeout hit")
    return 0
