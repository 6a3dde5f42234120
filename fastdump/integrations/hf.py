"""Hugging Face transformers: dump ``model.generate(...)``, assisted generation included.

    with dump_generate(model, "dump", assistant_model=draft) as dumpers:
        model.generate(input_ids, assistant_model=draft, max_new_tokens=16)

Roles ``target`` (``model``) and ``draft`` (``assistant_model``); each forward call of a model is one
pass, with metadata ``forward_mode``, ``batch_size``, ``num_tokens`` (input tokens, all sequences),
``cached_tokens`` (KV-cache length before the call) and ``call_index`` (the call's place among the
calls of both roles in this ``dump_generate``, from 0: sorting both roles' passes by it gives the
order they ran in). A target pass that scores candidate tokens (assisted generation, prompt lookup)
also has ``candidates`` (candidate tokens per sequence, 0 when the candidate generator proposed
none); a target pass that drafts candidates for itself (``assistant_early_exit=``) has ``draft: True``.
``forward_mode``:

- ``prefill``: nothing cached yet (the first call of a generate; in assisted generation it scores the
  first candidates too: see ``candidates``);
- ``decode``: one new token per sequence on top of the cache;
- ``verify``: the target scoring candidate tokens (of the assistant, or prompt lookup's) on top of
  the cache;
- ``extend``: several new tokens on top of a cache otherwise (the assistant catching up on the
  tokens the target accepted, or a chunked prompt).

An encoder-decoder's encoder and a vision-language model's image (video) encoding, which generate()
runs outside any forward of the model, are passes of their own (``forward_mode`` ``encode``).

transformers is optional (``pip install fastdump[hf]``); this module imports it nowhere.
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
import logging
from contextlib import contextmanager

import fastdump
from fastdump.capture.selection import select_modules

__all__ = ["dump_generate", "forward_meta"]

log = logging.getLogger("fastdump")


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


def _new_tokens(args, kwargs):
    """The tokens (ids or embeddings, [batch, tokens, ...]) a call feeds: an encoder-decoder's
    decoder input when it has one (its encoder runs once, see dump_generate), else the model's."""
    for key in ("decoder_input_ids", "decoder_inputs_embeds", "input_ids"):
        ids = kwargs.get(key)
        if ids is not None:
            return ids
    if args:
        return args[0]
    return kwargs.get("inputs_embeds")


def forward_meta(args, kwargs, *, verifies: bool = False, candidates: int | None = None) -> dict:
    """Pass metadata for one causal-LM forward call, from its arguments (no tensor work).

    ``candidates``: the candidate tokens per sequence this call scores (assisted generation), None
    when it scores none; ``verifies=True`` says the same without a count (any call feeding several
    tokens on top of a cache verifies)."""
    ids = _new_tokens(args, kwargs)
    batch, new = (ids.shape[0], ids.shape[1]) if ids is not None and ids.dim() >= 2 else (1, 0)
    # transformers 5 names the cache argument `cache`, 4.x `past_key_values`; MTP layers' `mtp_cache`
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("mtp_cache")))
    cached = _cached_tokens(cache)
    if cached == 0:
        mode = "prefill"
    elif new == 1:
        mode = "decode"
    else:
        mode = "verify" if verifies or candidates else "extend"
    meta = {"forward_mode": mode, "batch_size": batch, "num_tokens": batch * new, "cached_tokens": cached}
    if candidates is not None:
        meta["candidates"] = candidates
    return meta


def _on_stack(caller) -> bool:
    """``caller`` (id and code of a frame, see _Candidates) is running: a frame of the current stack.
    (Its id alone could be a later frame's at the same address; a frame itself, held, would keep an
    interrupted generate's cache alive.)"""
    if caller is None:
        return False
    frame_id, code = caller
    f = sys._getframe(1)
    while f is not None:
        if id(f) == frame_id and f.f_code is code:
            return True
        f = f.f_back
    return False


class _Candidates:
    """What the candidate generator of the running assisted generate proposed last: the length of
    the sequence it returned (prompt, accepted tokens and candidates) and the candidates in it.

    The target's next call, made from the loop that asked for them and covering exactly that
    sequence (cached + new tokens), scores them; any other call (a generate after an assisted one
    interrupted before its verify) does not."""

    def __init__(self):
        self.total, self.count = None, None
        self.caller = None  # (id, code) of the frame that asked for them: generate's decoding loop
        self.drafting = False  # inside the candidate generator: a call of the model is it drafting

    def take(self, args, kwargs, cached: int) -> int | None:
        total, count, caller = self.total, self.count, self.caller
        self.total = self.count = self.caller = None
        if total is None or not _on_stack(caller):  # (a generate interrupted before its verify: stale)
            return None
        ids = _new_tokens(args, kwargs)
        if ids is None or ids.dim() < 2 or cached + ids.shape[1] != total:
            return None
        return count

    def wrap_generator_factory(self, model, made=None):
        """Wrap ``model._get_candidate_generator`` (one instance attribute) so that every candidate
        generator it makes reports its candidates here, and ``made(generator)`` runs once it is made. False
        when the model has none to wrap."""
        if not callable(getattr(type(model), "_get_candidate_generator", None)) \
                or "_get_candidate_generator" in vars(model):
            return False
        state = self

        def _get_candidate_generator(self, *args, **kwargs):
            state.total = state.count = state.caller = None  # a new generate
            generator = type(self)._get_candidate_generator(self, *args, **kwargs)
            if made is not None:
                made(generator)
            get = getattr(generator, "get_candidates", None)
            if callable(get):
                def get_candidates(input_ids, *a, **k):
                    state.total = state.count = state.caller = None
                    state.drafting = True
                    try:
                        out = get(input_ids, *a, **k)
                    finally:
                        state.drafting = False
                    try:
                        total = int(out[0].shape[-1])
                        state.total, state.count = total, total - int(input_ids.shape[-1])
                        caller = sys._getframe(1)
                        state.caller = (id(caller), caller.f_code)
                    except Exception:  # an unknown generator's output: no count, never an error in generate
                        pass
                    return out
                try:
                    generator.get_candidates = get_candidates
                except Exception:
                    pass
            return generator

        # bound: a deep copy of the model binds it to the copy
        model._get_candidate_generator = types.MethodType(_get_candidate_generator, model)
        return True


class _Session:
    """What the roles of one ``dump_generate`` share: the count of their calls (``call_index``),
    and the models each Dumper watches, to check again for modules transformers puts in them."""

    def __init__(self, roots=()):
        self.calls = itertools.count()
        self.models = []  # (Dumper, model)
        self.roots = list(roots)  # every role's model: none is another's inner generation model
        self.on_generator = None  # called with each candidate generator generate() makes (dump_generate)

    def generator_made(self, generator) -> None:
        self.adopt_new_modules()
        if self.on_generator is not None:
            self.on_generator(generator)

    def adopt_new_modules(self) -> None:
        """Dump the modules transformers put into a model after attach (universal assisted
        generation prunes the assistant's lm_head into a new Linear, ``lm_head.pruned_lm_head``),
        selected as at attach: no wrapper would run for them, and what they compute would be
        missing from every pass without a word. Runs as generate() makes its candidate generator."""
        for dumper, model in self.models:
            if dumper.status != "running":
                continue  # (closed, or not dumping)
            try:
                o = dumper.options
                wrapped = {id(m) for m, _ in dumper._wrapped}
                left = tuple(dumper.not_wrapped)  # (left out at attach, with all inside: why is recorded)
                fresh = [(name, m) for name, m in select_modules(
                    model, layers=o.layers, include=o.include, exclude=o.exclude, module_types=o.module_types)
                    if id(m) not in wrapped and not any(name == n or name.startswith(n + ".") for n in left)]
            except Exception as exc:  # never an error in generate: said, and the modules go undumped
                log.warning("fastdump: %s: cannot check %s for new modules: %s", dumper.dir, type(model).__name__, exc)
                continue
            for name, module in fresh:
                try:
                    dumper.watch(module, name)
                    log.info("fastdump: %s: %s put into the model during generate(): dumped too", dumper.dir, name)
                except Exception as exc:
                    log.warning("fastdump: %s: %s, put into the model during generate(), is not dumped: %s",
                                dumper.dir, name, exc)


def _attach(model, root, role, verifies, attach_kwargs, session):
    # fastdump's forward wrappers keep the signature that generate() inspects (functools.wraps).
    dumper = fastdump.attach(model, root, role=role, **attach_kwargs)
    session.models.append((dumper, model))
    handles, undo = [], []  # hooks, and (object, attribute) pairs set: removed again by detach

    def detach():
        for handle in handles:
            handle.remove()
        for owner, attribute in undo:
            vars(owner).pop(attribute, None)

    try:
        meta_of = _generation_meta(model, role, verifies, undo, session)

        def pre_hook(module, args, kwargs):
            # Runs before fastdump's wrapper begins the pass: set_pass_meta then feeds the coming pass.
            meta = meta_of(args, kwargs)
            meta["call_index"] = next(session.calls)
            try:
                dumper.set_pass_meta(**meta)
            except Exception:
                pass

        handles.append(model.register_forward_pre_hook(pre_hook, with_kwargs=True))
        _outside_passes(model, dumper, session, role, verifies, handles, undo)
        _feature_passes(model, dumper, session, undo)
    except BaseException:  # (a model that refuses a hook): nothing of this role is left attached
        try:
            detach()
        finally:
            dumper.close()
        raise
    return dumper, detach


def _generation_meta(model, role, verifies, undo, session):
    """``meta_of(args, kwargs)``: the metadata of a forward of generation model ``model``, never
    raising (what it cannot work out is recorded as such). A target counts the candidates each call
    scores when transformers lets it see them (``model._get_candidate_generator``, recorded in
    ``undo``); else (an old or unknown transformers) every call of a target with an assistant that
    feeds several tokens on a cache is taken to verify."""
    candidates = _Candidates()
    counted = role == "target" and candidates.wrap_generator_factory(model, session.generator_made)
    if counted:
        undo.append((model, "_get_candidate_generator"))

    def meta_of(args, kwargs):
        try:
            if not counted:
                return forward_meta(args, kwargs, verifies=verifies)
            meta = forward_meta(args, kwargs)
            n = candidates.take(args, kwargs, meta["cached_tokens"])
            if n is not None:
                return forward_meta(args, kwargs, candidates=n)
            if candidates.drafting:  # the model drafting for itself (assistant_early_exit)
                meta["draft"] = True
            return meta
        except Exception as exc:
            return {"fastdump_meta_error": f"{type(exc).__name__}: {exc}"[:200]}
    return meta_of


def _outside_passes(model, dumper, session, role, verifies, handles, undo) -> None:
    """Modules that generate() runs outside any forward of ``model``, whose tensors no pass would
    hold, each call made a pass of its own (a call inside a forward of the model stays in its pass).

    - An encoder-decoder's encoder: generate() runs it once, before the first forward
      (``model.get_encoder()(...)``); ``forward_mode`` ``encode``.
    - A generation model inside ``model`` (a wrapper's, PEFT's ``base_model.model``, a multimodal
      model's ``language_model``) when ``model.generate`` hands generation to it: its forwards are
      the passes, with the metadata a root forward gets.

    The hooks' handles go to ``handles`` as they are made."""
    hooked = []
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        try:
            encoder = model.get_encoder()
        except Exception:
            encoder = None
        if encoder is not None and encoder is not model and hasattr(encoder, "register_forward_pre_hook"):
            hooked.append((encoder, _encoder_meta))
    for _, sub in model.named_modules():
        if all(sub is not m for m in session.roots) and _generates(sub) and all(sub is not m for m, _ in hooked):
            hooked.append((sub, _generation_meta(sub, role, verifies, undo, session)))
    for module, meta_of in hooked:
        _pass_of_its_own(module, dumper, session, meta_of, handles)


def _generates(module) -> bool:
    """A transformers generation model (``generate`` and ``prepare_inputs_for_generation``)."""
    try:
        return callable(getattr(module, "prepare_inputs_for_generation", None)) \
            and callable(getattr(module, "generate", None))
    except Exception:  # (an attribute lookup that raises: a proxy module's __getattr__)
        return False


def _encoder_meta(args, kwargs) -> dict:
    meta = {"forward_mode": "encode"}
    try:
        first = args[0] if args else None
        ids = kwargs.get("input_ids", first if first is not None and not first.is_floating_point() else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is not None and ids.dim() >= 2:
            meta.update(batch_size=int(ids.shape[0]), num_tokens=int(ids.shape[0] * ids.shape[1]), cached_tokens=0)
        else:  # features (Whisper's mel frames, pixels): sequences, but no tokens to count
            features = kwargs.get("input_features", first)
            if features is not None and features.dim() >= 2:
                meta.update(batch_size=int(features.shape[0]), cached_tokens=0)
    except Exception:  # an input it cannot read: the mode alone
        pass
    return meta


def _pass_of_its_own(module, dumper, session, meta_of, handles) -> None:
    """Hooks making each call of ``module`` outside a pass a (manual) pass, metadata ``meta_of(args,
    kwargs)``; a call that raises leaves it incomplete. Their handles go to ``handles``."""
    opened = []  # [id] of the pass these hooks began, while it is open

    def end(reason=None):
        pass_id = opened.pop()
        # Only that pass: close(), or a root forward finding it dangling, may have ended it already
        # and another be open now.
        if dumper.in_pass and dumper.pass_id == pass_id:
            dumper.end_pass(incomplete=reason)

    def before(module, args, kwargs):
        if opened:  # the previous call raised a BaseException that no hook saw (Ctrl-C)
            end(f"the forward of {type(module).__name__} was interrupted: its pass never ended")
        if dumper.in_pass:
            return
        try:
            meta = meta_of(args, kwargs)
        except Exception as exc:  # never into the model
            meta = {"fastdump_meta_error": f"{type(exc).__name__}: {exc}"[:200]}
        meta["call_index"] = next(session.calls)
        dumper.begin_pass(**meta)
        opened.append(dumper.pass_id)

    def after(module, args, output):
        if opened:
            # always_call: on an Exception in forward torch calls this with output None
            end(f"the forward of {type(module).__name__} raised" if output is None else None)

    handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
    handles.append(module.register_forward_hook(after, always_call=True))


def _feature_passes(model, dumper, session, undo) -> None:
    """A vision-language model's generate() encodes the images (videos) before the first forward,
    outside it: ``model.base_model.get_image_features(...)`` runs the vision tower and the projector,
    whose tensors no pass would hold. Make each such call a pass (``forward_mode`` ``encode``,
    ``modality``); one inside a forward of the model stays in its pass. The (object, attribute)
    pairs set (instance attributes over the class's methods) go to ``undo``."""
    base = getattr(model, "base_model", None)
    try:
        modalities = tuple(getattr(model, "input_modalities", ()) or ())
    except Exception:
        modalities = ()
    for modality in ("image", "video"):
        attribute = f"get_{modality}_features"
        if modality not in modalities or base is None or attribute in vars(base) \
                or not callable(getattr(type(base), attribute, None)):
            continue
        method = getattr(type(base), attribute)
        setattr(base, attribute, types.MethodType(_encoding_pass(dumper, session, method, modality), base))
        undo.append((base, attribute))


def _encoding_pass(dumper, session, method, modality):
    # generate() reads the method's signature to pick its arguments: keep it (functools.wraps)
    @functools.wraps(method)
    def encode(self, *args, **kwargs):
        if dumper.in_pass:
            return method(self, *args, **kwargs)
        # (one that raises leaves its pass incomplete, as a root forward's)
        with dumper.manual_pass(forward_mode="encode", modality=modality, call_index=next(session.calls)):
            return method(self, *args, **kwargs)
    return encode


@contextmanager
def dump_generate(model, root, *, assistant_model=None, **attach_kwargs):
    """Dump ``model`` as role ``target`` and ``assistant_model`` (if any) as role ``draft`` under ``root``.

    Yields ``{"target": Dumper, "draft": Dumper}`` (no "draft" without an assistant); everything is
    flushed and the models are restored on exit. ``attach_kwargs`` go to ``fastdump.attach`` (both roles).

    ``assistant_model=model`` (the model drafting for itself, a sanity check of speculative
    decoding): one Dumper, role ``target``, under both keys; the drafting calls are marked
    ``draft: True``. Two Dumpers on one model would each dump every call of both roles."""
    attached = []
    itself = assistant_model is model
    session = _Session(roots=(model, assistant_model))
    try:
        attached.append(("target", *_attach(model, root, "target", assistant_model is not None, attach_kwargs, session)))
        if assistant_model is not None and not itself:
            attached.append(("draft", *_attach(assistant_model, root, "draft", False, attach_kwargs, session)))
        dumpers = {role: dumper for role, dumper, _ in attached}
        if itself:
            dumpers["draft"] = dumpers["target"]
        elif assistant_model is None:
            session.on_generator = functools.partial(_attach_mtp, root, attach_kwargs, session, attached, dumpers)
        yield dumpers
    finally:
        # Every role is detached and closed even when closing one is interrupted (Ctrl-C in its
        # close): the first such exception is raised once all are done.
        error = None
        for _, dumper, detach in reversed(attached):
            try:
                try:
                    detach()
                finally:
                    dumper.close()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error


def _attach_mtp(root, attach_kwargs, session, attached, dumpers, generator) -> None:
    """``use_mtp=True``: generate() makes the multi-token-prediction layers (transformers'
    ``MtpModel``, the candidate generator's ``mtp_model``) after attach, and they draft the tokens
    the target verifies, as an EAGLE draft does (SGLang runs MTP heads as its EAGLE draft): role
    ``draft``, each of its forwards a draft pass, with its calls of the embedding and head it
    shares with the target. Every generate() makes a new one: a new draft Dumper (a session of
    its own), the previous one closed. Never an error in generate: a failure is said, MTP undumped."""
    import torch

    mtp = getattr(generator, "mtp_model", None)
    if not isinstance(mtp, torch.nn.Module):
        return
    try:
        previous = next((i for i, (role, _, _) in enumerate(attached) if role == "draft"), None)
        if previous is not None:
            _, dumper, detach = attached.pop(previous)
            try:
                detach()
            finally:
                dumper.close()
        session.roots.append(mtp)
        dumper, detach = _attach(mtp, root, "draft", False, attach_kwargs, session)
        attached.append(("draft", dumper, detach))
        dumpers["draft"] = dumper
    except Exception as exc:
        log.warning("fastdump: the MTP layers generate() made (%s) are not dumped: %s", type(mtp).__name__, exc)
