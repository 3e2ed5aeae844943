"""mergepipe Kubernetes operator: CRD models, pure decisions, kopf handlers (see README.md)."""
