"""Requests, the continuous batcher, sampling and the engine loop. No ray."""
