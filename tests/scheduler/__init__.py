"""Admission, pages, slots, chunked prefill and pipelined steps, against a double of the ranks."""
