"""The OpenAI-compatible HTTP frontend over the engine API (``server.app.create_app``)."""
