"""Thin Lightning callbacks: collect, call one analysis, log on rank zero."""
