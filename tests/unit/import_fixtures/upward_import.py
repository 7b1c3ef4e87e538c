"""A negative fixture (never imported from here): copied into ``lightning_nd/layout/`` by
`tests/unit/test_import_contracts.py`, it makes the pure layout import the strategy, and with it Lightning."""

from lightning_nd.strategy.nd_parallel import NDParallel  # noqa: F401
