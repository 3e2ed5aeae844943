"""Kubernetes helpers every resource uses: the API adapter (:mod:`.api`), conditions and their
Events (:mod:`.conditions`), units (:mod:`.quantities`), names (:mod:`.names`) and the worker Job
template (:mod:`.jobs`)."""
