"""The coordinator's side of the ranks: launch, handshake, dispatch, reply validation, poison."""
