"""The analytic cost model over a `Layout`: memory per rank (`memory.py`), bytes per mesh dim (`comm.py`) and step
time (`step_time.py`), all in one record per layout (`layout_cost.py`); what this host measured
(`profile.py`), by `calibrate.py`. No process group but the calibration's own, no Lightning."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "cost_layout": "lightning_nd.cost.layout_cost",
        "rank_memory": "lightning_nd.cost.memory",
    },
)
