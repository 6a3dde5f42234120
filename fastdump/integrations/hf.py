"""Hugging Face transformers: dump ``model.generate(...)``, assisted generation included.

    with dump_generate(model, "dump", assistant_model=draft) as dumpers:
        model.generate(input_ids, assistant_model=draft, max_new_tokens=16)

Roles ``target`` (``model``) and ``draft`` (``assistant_model``); each forward call of a model is one
pass, with metadata ``forward_mode``, ``batch_size``, ``num_tokens`` (input tokens, all sequences)
and ``cached_tokens`` (KV-cache length before the call). ``forward_mode``:

- ``prefill``: nothing cached yet (the first call of a generate);
- ``decode``: one new token per sequence on top of the cache;
- ``verify``: the target scoring several candidate tokens of the assistant at once;
- ``extend``: several new tokens on top of a cache otherwise (the assistant catching up on the
  tokens the target accepted, or a chunked prompt).

transformers is optional (``pip install fastdump[hf]``); this module imports it nowhere.
"""

from __future__ import annotations

from contextlib import contextmanager

import fastdump

__all__ = ["dump_generate", "forward_meta"]


def _cached_tokens(cache) -> int:
    if cache is None:
        return 0
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        return int(get())
    try:  # legacy tuple-of-tuples cache: ((k, v), ...) with k [batch, heads, seq, dim]
        return int(cache[0][0].shape[-2])
    except (TypeError, IndexError, AttributeError):
        return 0


def forward_meta(args, kwargs, *, verifies: bool = False) -> dict:
    """Pass metadata for one causal-LM forward call, from its arguments (no tensor work)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    batch, new = (ids.shape[0], ids.shape[1]) if ids is not None and ids.dim() >= 2 else (1, 0)
    # transformers 5 names the cache argument `cache`, 4.x `past_key_values`
    cached = _cached_tokens(kwargs.get("cache", kwargs.get("past_key_values")))
    if cached == 0:
        mode = "prefill"
    elif new == 1:
        mode = "decode"
    else:
        mode = "verify" if verifies else "extend"
    return {"forward_mode": mode, "batch_size": batch, "num_tokens": batch * new, "cached_tokens": cached}


def _attach(model, root, role, verifies, attach_kwargs):
    # fastdump's forward wrappers keep the signature that generate() inspects (functools.wraps).
    dumper = fastdump.attach(model, root, role=role, **attach_kwargs)

    def pre_hook(module, args, kwargs):
        # Runs before fastdump's wrapper begins the pass: set_pass_meta then feeds the coming pass.
        dumper.set_pass_meta(**forward_meta(args, kwargs, verifies=verifies))

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return dumper, handle


@contextmanager
def dump_generate(model, root, *, assistant_model=None, **attach_kwargs):
    """Dump ``model`` as role ``target`` and ``assistant_model`` (if any) as role ``draft`` under ``root``.

    Yields ``{"target": Dumper, "draft": Dumper}`` (no "draft" without an assistant); everything is
    flushed and the models are restored on exit. ``attach_kwargs`` go to ``fastdump.attach`` (both roles)."""
    attached = []
    try:
        attached.append(("target", *_attach(model, root, "target", assistant_model is not None, attach_kwargs)))
        if assistant_model is not None:
            attached.append(("draft", *_attach(assistant_model, root, "draft", False, attach_kwargs)))
        yield {role: dumper for role, dumper, _ in attached}
    finally:
        for _, dumper, handle in reversed(attached):
            handle.remove()
            dumper.close()
