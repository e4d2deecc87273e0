"""Helpers the test modules share: a live server, rank launch pieces, a double of the ranks (and a
scheduler driver over it), a rank's step runner, log reading, and the Triton interpreter and GPU
checks."""
