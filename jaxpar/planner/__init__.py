"""The planner: analytic per-device memory, FLOPs and step time of a jaxpar layout, and a layout
recommender (python -m jaxpar.plan). docs/planner.md compares it with the compiled program."""
