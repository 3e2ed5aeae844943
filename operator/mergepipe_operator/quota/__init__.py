"""MergeQuota: the accounting as pure functions (:mod:`.decisions`), the ledger with conditioned
writes (:mod:`.controller`) and the kopf handlers (:mod:`.handlers`)."""
