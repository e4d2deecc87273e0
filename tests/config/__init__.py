"""Tests of the config layer: the replica config tree and the environment settings."""
