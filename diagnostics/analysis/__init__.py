"""Pure functions over recorded data; no Lightning imports."""
