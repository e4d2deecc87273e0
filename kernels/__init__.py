"""phalanx's kernels: each Triton kernel beside its torch reference (see ``kernels/ops.py``)."""

import os

# Every kernel was checked and timed with floating-point fusion (FMA contraction) on, Triton's
# default through 3.9; Triton 3.10 turns it off by default. Asking for it keeps the kernels'
# numerics across Triton releases (and silences 3.9's warning); an explicit setting still wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
