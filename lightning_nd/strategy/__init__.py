"""The Lightning glue: `NDParallel` and the collaborators its hooks call (pipeline engine, checkpointer,
failure monitor, events, data position)."""
