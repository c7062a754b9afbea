"""The aiohttp orchestrator (installed as `egomem.orchestrator`): streams, polling, query detection,
memory writes. It talks to the models only through Triton."""
