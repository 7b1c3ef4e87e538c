"""Pipeline parallelism: stage modules built from the split (`layout/pipeline_split.py`), the schedule runner and
forward-only evaluation."""
