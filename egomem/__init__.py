"""EgoMem: lifelong memory of people for full-duplex speech+vision dialog models, served on Triton.

Layout (docs/architecture.md#repository-layout): `egomem` core (config, networks, perception, memory, CLI), `egomem.kernels`
(Triton-language kernels, from the top-level `kernels/` folder) and `egomem.orchestrator` (the
aiohttp service, from `orchestrator/`). Dependencies point one way: orchestrator -> egomem -> kernels.
"""

__version__ = "0.1.0"
