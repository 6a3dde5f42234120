"""Engine integrations, each importable on its own (none is imported here, so fastdump needs neither):

- ``fastdump.integrations.sglang``: ``register_forward_hook_for_model`` with SGLang's signature,
  ``install()`` / ``python -m fastdump.integrations.sglang`` for ``--debug-tensor-dump-output-folder``.
- ``fastdump.integrations.hf``: ``dump_generate`` for transformers' ``generate`` (assisted included).
- ``fastdump.integrations.vllm``: ``attach`` for models whose logits are computed after the forward
  (vLLM's ``compute_logits``): each forward and its logits one pass.
"""
