"""Small models for the examples and tests; each trains on one device and under any layout unchanged."""
