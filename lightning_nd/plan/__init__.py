"""``python -m lightning_nd.plan``: the planner's command line under its first name (it lives in `planner/`)."""
