"""A negative fixture (never imported from here): copied into ``lightning_nd/cost/`` by
`tests/unit/test_import_contracts.py`, it makes a pure layer import Lightning itself."""

import lightning.pytorch  # noqa: F401
