"""ModelMerge: parameter validation (:mod:`.params`), spec validation (:mod:`.spec`), pure
decisions (:mod:`.decisions`), in-process planning (:mod:`.planning`), the reconciler
(:mod:`.controller`) and the kopf handlers (:mod:`.handlers`)."""
