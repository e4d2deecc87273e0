"""The repository root off the front of ``sys.path``.

The layers' folders sit at the top of the repository (``kernels/``, ``tools/``, ``models/`` …) and
are imported as ``phalanx.<layer>``. Run from the root, ``python -m`` (and pytest) put the root
first on ``sys.path``, where those folders shadow installed distributions of the same name:
transformers imports the ``kernels`` distribution and would get ``kernels/`` instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent


def keep_repository_last() -> None:
    """Moves every ``sys.path`` entry naming the repository root (``''`` too, run from there) to
    the end, so an installed distribution wins over a layer folder of the same name."""
    ours = [entry for entry in sys.path if Path(entry or ".").resolve() == REPOSITORY]
    if ours:
        sys.path[:] = [entry for entry in sys.path if entry not in ours] + [str(REPOSITORY)]
