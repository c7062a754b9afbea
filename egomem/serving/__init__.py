"""Serving base: the tritonserver launcher, the async Triton client, the wire schema of the sequence-batched
models and what their adapters share (adapter.py, streams.py)."""
