"""The planner's command line, ``python -m lightning_nd.planner`` (also ``python -m lightning_nd.plan``): the dry run
of one layout, and every valid layout of a model costed and ranked."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "dry_run": "lightning_nd.planner.dry_run",
        "search": "lightning_nd.planner.search",
    },
)
