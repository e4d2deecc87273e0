"""How many ranks share this host's cores."""

from __future__ import annotations

import os


def ranks_on_this_host(world_size: int) -> int:
    """How many ranks share this host's cores: torchrun says so for attached ranks
    (``LOCAL_WORLD_SIZE``); ranks the coordinator spawns all share its host."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
