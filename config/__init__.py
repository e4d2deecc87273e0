"""The bottom layer: the replica's typed config tree (``replica.py``) and every ``PHALANX_*``
environment variable (``settings.py``). It imports no other layer; every layer may import it."""
