"""KV-cache- and queue-aware autoscaling: collect pod metrics, decide (HPA maths), act (scale subresource)."""
