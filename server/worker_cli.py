"""`pagoda worker`: the tensor-parallel ranks of one node of a multi-node group (a LeaderWorkerSet pod).

It starts this node's ranks (`--node-rank`, or the pod's LeaderWorkerSet worker index), which join the
leader's `pagoda serve` at MASTER_ADDR (or LWS_LEADER_ADDRESS):MASTER_PORT, and answers /health and
/ready on the server's port while they all run. It exits when one of them exits: non-zero unless
every rank was told to stop, so the kubelet (and LWS, which recreates the group) restarts it.
"""

from __future__ import annotations

import argparse
import os

HELP = "run this node's tensor-parallel ranks of a multi-node serving group"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagoda.server.engine.config import EngineArgs

    env = os.environ.get
    group = parser.add_argument_group("worker")
    group.add_argument(
        "--node-rank",
        type=int,
        default=env("PAGODA_NODE_RANK") or env("LWS_WORKER_INDEX"),
        help="this node's index in the group (leader: 0; default: the LWS worker index)",
    )
    group.add_argument("--host", default=env("PAGODA_HOST", "0.0.0.0"), help="address of /health")
    group.add_argument("--port", type=int, default=env("PAGODA_PORT", "8000"), help="port of /health")
    EngineArgs.add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    import logging

    from pagoda.server.engine.config import EngineArgs
    from pagoda.server.engine.parallel.group import rendezvous_env
    from pagoda.server.engine.parallel.launch import run_node

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank is None or int(args.node_rank) < 1:
        raise SystemExit("pagoda worker: --node-rank must be 1 or more (node 0 runs `pagoda serve`)")
    engine_args = EngineArgs.from_cli_args(args)
    return run_node(engine_args, int(args.node_rank), *rendezvous_env(), (args.host, args.port))
