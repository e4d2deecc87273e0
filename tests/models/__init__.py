"""Qwen3.5: config, checkpoint loading, the forward against transformers, the tiny checkpoint."""
