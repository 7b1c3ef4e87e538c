"""Context parallelism: zigzag sequence sharding of a batch and the region that routes attention to ring attention."""
