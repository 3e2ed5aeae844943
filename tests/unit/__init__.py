"""Fast in-process tests: pure decisions, parsers, kernels, the planner, docs and layout."""
