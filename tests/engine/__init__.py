"""The engine API (submit, stream, cancel) over a double of the ranks and over real ranks."""
