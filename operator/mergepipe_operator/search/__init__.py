"""MergeSearch: pure decisions (:mod:`.decisions`), the reconciler (:mod:`.controller`) and the
kopf handlers (:mod:`.handlers`). The driver's side is :mod:`mergepipe_kube.search`."""
