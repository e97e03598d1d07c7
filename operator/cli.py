"""`pagoda operator`: run the InferenceService operator (kopf) with liveness and metrics endpoints."""

from __future__ import annotations

import argparse
import random

HELP = "Run the Kubernetes operator for InferenceService resources (kopf)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", action="append", default=[], metavar="NS",
                       help="serve InferenceServices in this namespace (repeatable; globs allowed)")
    scope.add_argument("--all-namespaces", action="store_true", help="serve every namespace (cluster-wide)")
    parser.add_argument("--health-port", type=int, default=8080, help="liveness endpoint /healthz port")
    parser.add_argument("--metrics-port", type=int, default=8081,
                        help="operator Prometheus metrics /metrics port (0: off)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME",
                         help="kopf peering object: of several replicas only one acts at a time")
    peering.add_argument("--standalone", action="store_true", help="no peering (one replica only)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority; default: random, so the highest of the replicas acts and "
                             "the others wait (kopf pauses every operator when the top priority is shared)")
    parser.add_argument("--status-interval", type=float, default=10.0,
                        help="seconds between status refreshes of each InferenceService")
    parser.add_argument("--server-image", default="",
                        help="default serving image (else env PAGODA_SERVER_IMAGE)")
    parser.add_argument("--no-autoscaler", dest="autoscaler", action="store_false",
                        help="never scale: leave spec.replicas to KEDA, an HPA or people, even where "
                             "spec.autoscaling.enabled is true (status.kvCache is still reported)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def peering_priority(args: argparse.Namespace) -> int:
    if args.priority is not None:
        return args.priority
    return random.randint(1, 2**31 - 1) if args.peering else 0


def main(args: argparse.Namespace) -> int:
    import logging

    import kopf
    import prometheus_client
    from pagoda.operator import handlers
    from pagoda.operator.autoscaling.handlers import SWITCH

    SWITCH.enabled = args.autoscaler
    handlers.CONFIG.status_interval = args.status_interval
    handlers.CONFIG.default_image = args.server_image
    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
        standalone=args.standalone or None,
        peering_name=args.peering,
        priority=peering_priority(args),
    )
    return 0
