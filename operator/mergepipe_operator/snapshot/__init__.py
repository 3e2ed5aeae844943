"""MergedSnapshot: manifest verification as pure functions (:mod:`.decisions`), the verifier
(:mod:`.controller`) and the kopf handlers (:mod:`.handlers`)."""
