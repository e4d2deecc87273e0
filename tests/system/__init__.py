"""The product end to end as a user starts it: real ``phalanx serve`` / ``generate`` processes,
signals, injected faults, fuzzed frames, clients."""
