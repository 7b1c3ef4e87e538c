"""The dry run, ``python -m lightning_nd.plan``: a layout's plan for a model, shown before any process starts."""
