"""Serving base: the tritonserver launcher and the async Triton client."""
