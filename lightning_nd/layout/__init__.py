"""The Layout itself: one frozen, JSON-able record of what every rank holds and why (`record.py`), made once per run
by `plan_layout` (`plan.py`) from the dims, the options (`options.py`) and each technique's own planning.

No process group and no Lightning here: everything runs on a meta-device model before launch.
"""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Layout": "lightning_nd.layout.record",
        "plan_layout": "lightning_nd.layout.plan",
    },
)
