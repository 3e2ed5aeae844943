"""Kubernetes helpers every resource uses, importing no resource: the API adapter (:mod:`.api`),
the model parts the kinds share (:mod:`.model`), conditions and their Events
(:mod:`.conditions`), names (:mod:`.names`), Kueue's Job label (:mod:`.queueing`), the worker
Job template (:mod:`.jobs`) and the tenant-image rule (:mod:`.images`)."""
