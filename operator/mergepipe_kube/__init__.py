"""Kubernetes-facing code shared by the operator (:mod:`mergepipe_operator`) and the
``mergepipe search --worker-backend kubernetes`` driver, kept out of the core package (which never
imports kubernetes):

- :mod:`mergepipe_kube.names`: the one naming rule for objects both create;
- :mod:`mergepipe_kube.search`: the search driver's worker backend (candidates as ModelMerges,
  evaluations as Jobs), found by the CLI through the ``mergepipe.worker_backends`` entry point.
"""
