"""``python -m lightning_nd.plan ...`` runs ``python -m lightning_nd.planner ...``, arguments and exit code alike."""

import sys

from lightning_nd.planner.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
