"""Each op's torch reference and its Triton version (under ``TRITON_INTERPRET=1`` on CPU)."""
