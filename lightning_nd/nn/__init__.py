"""Reference layers that parallelize cleanly (no Lightning imports)."""
