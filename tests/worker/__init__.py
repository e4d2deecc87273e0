"""One rank: its checks and command loop, slots, sampling, grammar, graph runner, capacity, faults."""
