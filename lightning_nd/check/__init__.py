"""`python -m lightning_nd.plan ... --check`: every distinct rank's real setup and one training step on fake
tensors, with torch's fake process group, in one CPU process, before a cluster is booked (`run.py`)."""

from lightning_nd.check.report import check_markdown
from lightning_nd.check.run import CheckResult, RankOutcome, check_layout

__all__ = ["CheckResult", "RankOutcome", "check_layout", "check_markdown"]
