"""The wire and launch contract, trace files, transport, frame authentication and log lines."""
