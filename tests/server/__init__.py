"""The OpenAI-compatible server, over real HTTP and in pieces."""
