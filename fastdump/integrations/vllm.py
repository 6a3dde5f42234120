"""vLLM (and engines shaped like it): one pass per forward, its logits included.

vLLM's model runner calls the model's ``forward`` (hidden states out), then, outside it,
``model.compute_logits(hidden[logits_indices])``; its EAGLE proposer does the same once per draft
step. With root passes (fastdump's default) each pass is the forward alone and the logits processor's
calls, in no pass, are not dumped. :func:`attach` makes each pass span a forward and the
``compute_logits`` call that follows it:

    with fastdump.integrations.vllm.attach(runner.get_model(), "dump", role="target") as target, \\
         fastdump.integrations.vllm.attach(runner.drafter.model, "dump", role="draft") as draft:
        ...  # serve (enforce_eager: no CUDA graphs, no torch.compile of the model's __call__)

A pass begins as the model is called (a forward pre-hook) and ends when its ``compute_logits``
returns, or, when none follows (a pipeline stage before the last, a dummy run), as the next call
of the model begins or at ``close()``. A ``compute_logits`` with no forward before it is a pass of
its own (``logits_only``). Calls inside a pass the caller opened (``dumper.manual_pass()``: a whole
engine step as one pass) stay in that pass. Nothing here raises into the model: a failure to begin
or end a pass is logged, the model runs on. No vLLM import: the model is any ``nn.Module`` with a
``compute_logits`` method, called through ``__call__`` (hooks do not run for ``model.forward(...)``).
"""

from __future__ import annotations

import logging

import fastdump

__all__ = ["attach", "LogitsPasses"]

log = logging.getLogger("fastdump")


def _tokens_meta(args, kwargs) -> dict:
    """``num_tokens``: the length of the flat token batch vLLM feeds (``input_ids`` or ``positions``)."""
    for key in ("input_ids", "positions"):
        t = kwargs.get(key)
        if t is not None and hasattr(t, "shape") and len(t.shape) >= 1:
            return {"num_tokens": int(t.shape[-1])}
    first = args[0] if args else None
    if first is not None and hasattr(first, "shape") and len(first.shape) >= 1:
        return {"num_tokens": int(first.shape[-1])}
    return {}


def _open(dumper, meta) -> None:
    # A frame of its own: begin_pass() keeps its caller's frame until the pass ends (to tell a
    # dangling pass), and the hook's frame would keep the forward's arguments alive with it.
    dumper.begin_pass(**meta)


class LogitsPasses:
    """What :func:`attach` returns: the Dumper (``.dumper``) and the hooks that make its passes;
    ``close()`` (or leaving the ``with`` block) removes them, restores ``compute_logits`` and closes
    the Dumper."""

    def __init__(self, model, dumper, method: str = "compute_logits"):
        self.model, self.dumper, self._method = model, dumper, method
        self._opened = None  # id of the pass the hooks began, while it is open
        self._handles = []
        original = getattr(type(model), method, None)
        if not callable(original):
            raise TypeError(f"{type(model).__name__} has no {method}() method: its logits would not be dumped")
        if method in vars(model):
            raise ValueError(f"{type(model).__name__}.{method} is set on the instance already (attached twice?)")
        self._handles.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._after_forward, always_call=True))
        passes = self

        def compute_logits(*args, **kwargs):
            return passes._logits(original, model, args, kwargs)

        setattr(model, method, compute_logits)
        self._wrapper = compute_logits

    # --- the hooks: never raising into the model --------------------------------------------------

    def _end(self, reason=None) -> None:
        pass_id, self._opened = self._opened, None
        try:
            # Only the pass these hooks began: close() may have ended it, and another be open now.
            if self.dumper.in_pass and self.dumper.pass_id == pass_id:
                self.dumper.end_pass(incomplete=reason)
        except Exception as exc:
            log.warning("fastdump: %s: cannot end pass %s: %s", self.dumper.dir, pass_id, exc)

    def _before_forward(self, module, args, kwargs):
        if self._opened is not None:  # the previous forward had no compute_logits (a PP stage, a dummy run)
            self._end()
        if self.dumper.in_pass or self.dumper.status != "running":
            return  # inside the caller's pass (manual_pass): the forward joins it
        try:
            _open(self.dumper, _tokens_meta(args, kwargs))
            self._opened = self.dumper.pass_id
        except Exception as exc:
            log.warning("fastdump: %s: cannot begin a pass: %s", self.dumper.dir, exc)

    def _after_forward(self, module, args, output):
        if self._opened is not None and output is None:
            # always_call: torch calls this with output None when the forward raised
            self._end(f"the forward of {type(module).__name__} raised")

    def _logits(self, original, model, args, kwargs):
        if self._opened is None:
            if self.dumper.in_pass or self.dumper.status != "running":
                return original(model, *args, **kwargs)
            try:
                _open(self.dumper, {"logits_only": True})
                self._opened = self.dumper.pass_id
            except Exception as exc:
                log.warning("fastdump: %s: cannot begin a pass: %s", self.dumper.dir, exc)
        try:
            out = original(model, *args, **kwargs)
        except BaseException as exc:
            if self._opened is not None:
                self._end(f"{self._method} raised {type(exc).__name__}")
            raise
        if self._opened is not None:
            self._end()
        return out

    # --- detaching --------------------------------------------------------------------------------

    def close(self) -> dict:
        """End the pass a forward left open (its forward returned: it is whole), remove the hooks,
        restore ``compute_logits``, close the Dumper; its stats."""
        try:
            if self._opened is not None:
                self._end()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if vars(self.model).get(self._method) is self._wrapper:
                del self.model.__dict__[self._method]
        finally:
            stats = self.dumper.close()
        return stats

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def attach(model, root, *, role: str = "target", compute_logits: str = "compute_logits",
           **attach_kwargs) -> LogitsPasses:
    """Dump ``model`` (vLLM's ``XxxForCausalLM``, or its EAGLE proposer's model as role ``draft``)
    with each forward and the ``compute_logits`` after it as one pass. ``attach_kwargs`` go to
    ``fastdump.attach`` (``root_passes`` is this helper's: False). Pass metadata: ``num_tokens``
    (the forward's flat token count), or ``logits_only`` for a ``compute_logits`` without a forward
    before it."""
    if attach_kwargs.get("root_passes", False):
        raise ValueError("vllm.attach makes the passes itself: root_passes must be False")
    attach_kwargs["root_passes"] = False
    dumper = fastdump.attach(model, root, role=role, **attach_kwargs)
    try:
        return LogitsPasses(model, dumper, compute_logits)
    except BaseException:
        dumper.close()
        raise
