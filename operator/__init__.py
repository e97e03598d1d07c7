"""The kopf operator: InferenceService -> Deployment, PVC, Service, ServiceMonitor; autoscaling."""
