"""Probes that record, never format: the flight recorder, every thread's stack, the point-to-point ledger."""
