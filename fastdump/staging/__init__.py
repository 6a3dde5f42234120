"""The serving side's second stage: one staging engine per process (``engine``: the shared-memory
ring and the writer process it spawns), a Dumper's staging object on it (``channel``), the
CUDA / foreign-array staging (``cuda``), CUDA-graph record mode (``graphs``) and the choice of
tensor reader for the C++ hot path (``tensor_reader``).

Nothing here imports ``fastdump.capture``: the capture layer sits above and registers its exit hook
with ``engine.on_exit``.
"""
