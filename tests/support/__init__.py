"""Helpers the test modules share: a live server, rank launch pieces, a double of the ranks, log
reading, and the Triton interpreter and GPU checks."""
