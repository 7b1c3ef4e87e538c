"""Pipeline parallelism: where the model splits into stages (`split.py`) and which schedules fit (`schedules.py`),
both pure; the stage modules (`stage.py`, `build.py`), the schedule runner (`runner.py`), forward-only evaluation,
tied weights and auxiliary losses across stages."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "split_stages": "lightning_nd.pipeline_parallel.split",
        "build_stages": "lightning_nd.pipeline_parallel.build",
    },
)
