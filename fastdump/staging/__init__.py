"""The serving side's second stage: one staging engine per process (``engine``: the shared-memory
ring and the writer process it spawns) and the CUDA / foreign-array staging (``cuda``).

Nothing here imports ``fastdump.capture``: the capture layer sits above and registers its exit hook
with ``engine.on_exit``.
"""
