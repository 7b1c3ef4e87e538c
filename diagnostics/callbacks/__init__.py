"""Thin Lightning callbacks: collect, call a pure analysis or renderer, log on rank zero."""
