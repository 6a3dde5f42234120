"""Which modules are wrapped, under which names, as the model changes: the selection wrapped
at attach (``_install``), then modules put in, replaced, moved, renumbered or removed
after attach (torch's registration hook, and ModuleList/Sequential/ModuleDict edits
that call none), and the check at close for edits no hook reports.

``FollowingMixin``'s methods are the Dumper's (fastdump/capture/dumper.py): one ``self``, the
attributes Dumper.__init__ sets; see docs/INTERNALS.md.
"""

from __future__ import annotations

import collections
import functools
import logging
import weakref

from .selection import (named_modules, original as _original_module, root_selected as _root_selected, select_modules,
                        select_subtree as _select_subtree, SHARED_LEFT_OUT_REASON as _SHARED_LEFT_OUT,
                        SHADOWED_REASON as _SHADOWED_REASON, forward_shadowed as _forward_shadowed)
from .forward_slot import _is_ours, _put_back, _remove_copier
from .tensors import _torch
from .text import _short
from .wrappers import _owner_of

log = logging.getLogger("fastdump")


class FollowingMixin:
    """The Dumper's wrapped modules: chosen at attach, followed through the model's edits."""

    def _install(self, model, root_passes: bool, **selection) -> None:
        self._model_ref = weakref.ref(_original_module(model))
        # The model's modules and names, walked before the selection: a module another thread puts in
        # while attach walks and wraps is not in it, and is caught up with once the hook is in
        # (_follow_registrations). Walked after, it was taken for one seen at attach: never dumped,
        # and the check at close, which trusts _paths, said nothing (verify OK).
        paths = _module_paths(model)
        scripted = {name: why for name, why in self.not_wrapped.items()  # (with all inside)
                    if why != _SHADOWED_REASON and name not in self._shared_left_out}
        selected = list(select_modules(model, **selection, scripted=scripted))
        root_selected = _root_selected(model, self._root_name, selection)
        if any(_original_module(m) is not m for m in model.modules()):
            # torch.compile'd (the model or a submodule): Python wrappers from the start. The C ones
            # switch at their first call in a pass, once Dynamo has met them in its first trace: a
            # graph break in the model's loop over its layers, for which Dynamo skips the model's
            # forward for good. The root wrapper of torch.compile(model) runs before Dynamo starts,
            # so never saw it either: the compiled model ran eagerly, every pass, without a word.
            self._python_wrappers = True
        chosen = {k: v for k, v in selection.items() if v is not None}
        if not selected and not root_selected and chosen:  # (a typo: FASTDUMP_MODULE_TYPES=Linaer)
            log.warning("fastdump: %s: the selection %s matches no module of the model: passes are counted, "
                        "no tensor is dumped", self.dir,
                        ", ".join(f"{k}={getattr(v, 'pattern', v)!r}" for k, v in chosen.items()))
        self._module_names.update(name for name, _ in selected)
        if root_selected:
            self._module_names.add(self._root_name)
        # Modules whose tuple output's parts would read as a selected child's name (``m.0``, a
        # Sequential's): the C wrapper names tuple parts without asking, so these take the Python
        # wrapper, which checks each part's name (_name_taken).
        self._indexed_parents = {head for head, _, tail in (n.rpartition(".") for n in self._module_names)
                                 if head and tail.isdigit()}
        for name, module in selected:
            self._wrap(module, self._capture_wrapper(name, module.forward, _owner_of(module)))
        self._follow_registrations(model, selection, paths)
        if _forward_shadowed(model):
            return  # no wrapper of the root would run: recorded in not_wrapped (no root passes)
        if root_passes:
            # Two Dumpers on this one model nest root wrapper in root wrapper at every forward: their
            # passes must not suspend each other as another model's pass nested in one does.
            self._state.root_key = id(_original_module(model))
            self._wrap(model, self._root_wrapper(self._root_name if root_selected else None, model.forward,
                                                 _owner_of(model)))
        else:
            # The root's forward outside a pass of this Dumper: see _outside_pass_wrapper. (Keyed to
            # the model as a root wrapper's passes are: another Dumper's pass on this same model is
            # not another model's, and is not suspended by this one's.)
            self._state.root_key = id(_original_module(model))
            owner = _owner_of(model)
            inner = self._capture_wrapper(self._root_name, model.forward, owner) if root_selected else None
            self._wrap(model, self._outside_pass_wrapper(inner, model.forward, owner))

    def _follow_registrations(self, model, selection: dict, paths) -> None:
        """Wrap the modules put into the model after attach (``model.layers[0] = new``, a LoRA or
        quantization wrapper set in a module's place), selected as at attach under the name they
        take: no wrapper would run for them, and their outputs were missing from every pass without
        a word (verify OK). torch calls a global module registration hook from ``__setattr__``,
        ``add_module`` and ``register_module`` (not on a direct ``_modules[name] = m``): a dict
        lookup per registration anywhere in the process while a Dumper is attached, none per forward.
        ``paths``: _module_paths(model), walked before the selection."""
        if _torch is None:
            return
        self._paths = paths
        # name -> the module its capture wrapper dumps under it (one module per name: _adopt)
        self._holders = {name: module for name, module in self._wrapped_capture()}
        # The hook is global (torch's): it holds this Dumper weakly, and goes with it. Held strongly,
        # a Dumper dropped without close() was never collected, nor its model, its rank directory's
        # descriptor or its ring: one of each per attach, for the process's life.
        me = weakref.ref(self)

        def registered(parent, name, module):
            dumper = me()
            try:  # (a module class with __eq__ and no __hash__ cannot be looked up: not ours)
                prefix = paths.get(parent) if isinstance(name, str) and dumper is not None else None
            except TypeError:
                return None
            if prefix is None or module is None:
                return None
            try:
                with dumper._lock:  # (close() on another thread: its wrappers come off before or after this)
                    if not dumper._closed:
                        full = f"{prefix}.{name}" if prefix else name
                        old = parent._modules.get(name)  # (the hook runs before the assignment)
                        if old is not None and old is not module:
                            dumper._replaced(old, module, full)
                        dumper._adopt(full, module, selection)
            except Exception as exc:  # never into the model: said, and the module goes undumped
                log.warning("fastdump: %s: %s, put into the model after attach, is not dumped: %s: %s",
                            dumper.dir, name, type(exc).__name__, _short(exc))
            return None

        self._registration_hook = _torch.nn.modules.module.register_module_module_registration_hook(registered)
        weakref.finalize(self, self._registration_hook.remove)  # (the handle's remove: a second is a no-op)
        self._selection = selection
        _follow_renumbering(self)
        with self._lock:
            self._catch_up(model, selection)

    def _catch_up(self, model, selection: dict) -> None:
        """Edits another thread made to the model while attach walked and wrapped it, before the
        registration hook was in (the hook runs before each assignment: one it missed is in the model
        by now). Each module put in is followed as the hook follows a registration, under the name
        it took; each wrapped module the model now holds elsewhere (a container replaced by a
        reordered one) or nowhere is renamed or unwrapped, as the hook's _replaced does. (An
        assignment whose registration began before the hook was in and lands after this walk stays
        unseen here: the check at close finds it, as a direct ``_modules`` write.)"""
        newcomers = []
        for name, module in named_modules(model):
            try:
                if module in self._paths:
                    continue
            except TypeError:  # (unhashable: never followed)
                continue
            if not any(_at_or_under(name, n) for n, _ in newcomers):  # (its own _adopt)
                newcomers.append((name, module))
        if not newcomers:
            return  # (the common case: nothing changed while attach ran)
        for name, module in newcomers:
            self._adopt(name, module, selection)
        held = _places(model)
        for name, holder in list(self._holders.items()):
            if self._holders.get(name) is holder and id(holder) not in held:
                self._free_name(name, None)  # (replaced while attach ran: left the model)
        self._rename({name: held[id(holder)][0] for name, holder in self._holders.items()
                      if not any(_at_or_under(p, name) for p in held[id(holder)])})
        for module in list(self._paths.keys()):
            if id(module) not in held:
                del self._paths[module]
            elif self._paths[module] not in held[id(module)]:
                self._paths[module] = held[id(module)][0]

    def _wrapped_capture(self):
        """(name, module) of the modules wrapped by a capture wrapper (not the root's)."""
        for module, wrapper in self._wrapped:
            name = getattr(wrapper, "_fastdump_name", None) or getattr(wrapper, "__fastdump_name__", None)
            if name is not None:
                yield name, module

    def _adopt(self, prefix: str, module, selection: dict) -> None:
        """Wrap what the selection keeps of ``module``, now registered in the model as ``prefix``.
        A module already wrapped keeps its wrapper and the name it had (one moved into a wrapper
        set in its place: ``model.proj = LoRA(model.proj)``), unless a module put in now takes that
        name (see _free_name)."""
        earlier = {}  # id -> the name a module of it already has in the model (held twice)
        for name, sub in named_modules(module):
            path = f"{prefix}.{name}" if name else prefix
            try:
                first = self._paths.get(sub)
            except TypeError:  # (unhashable, as above)
                continue
            if first is not None and first != path and self._still_at(first, sub):
                earlier[id(sub)] = first
            else:  # (a name it had before it left the model is stale: registrations inside it take this one)
                self._paths[sub] = path
        if any(_original_module(m) is not m for m in module.modules()):
            self._use_python_wrappers()  # a torch.compile'd module put in: as at attach (_install)
        wrapped = {id(m) for m, _ in self._wrapped}
        fresh = [(name, sub) for name, sub in _select_subtree(module, prefix, **selection) if id(sub) not in wrapped]
        for name, sub in [(n, m) for n, m in fresh if id(m) in earlier]:
            # Also under a name the selection leaves out (else it would be wrapped): as at attach
            # (selection.shared_left_out), not dumped; wrapped, the calls through the left-out name
            # read as this name's next calls (``b#1``), and verify said OK.
            fresh.remove((name, sub))
            self.not_wrapped[earlier[id(sub)]] = _SHARED_LEFT_OUT.format(kept=name)
            log.warning("fastdump: %s: not wrapped: %s: %s", self.dir, earlier[id(sub)],
                        self.not_wrapped[earlier[id(sub)]])
        for name, _ in fresh:
            self._free_name(name, prefix)
        self._module_names.update(name for name, _ in fresh)
        self._indexed_parents |= {head for head, _, tail in (name.rpartition(".") for name, _ in fresh)
                                  if head and tail.isdigit()}  # (as _install: these take the Python wrapper)
        for name, sub in fresh:
            self._wrap(sub, self._capture_wrapper(name, sub.forward, _owner_of(sub)))
            self._holders[name] = sub
        if fresh:
            log.info("fastdump: %s: %s put into the model after attach: dumped too", self.dir,
                     ", ".join(name for name, _ in fresh))

    def _still_at(self, name: str, module) -> bool:
        """Whether the model holds ``module`` under ``name`` now."""
        model = self._model_ref()
        if model is None:
            return False
        for path, sub in named_modules(model, remove_duplicate=False):
            if path == name:
                return sub is module
        return False

    def _free_name(self, name: str, replaced: str | None) -> None:
        """A module put in now takes ``name``, which another wrapped module dumps under: two modules
        under one name read as one module called twice (``del model.layers[1]`` renumbers the rest
        unseen, and ``append`` then put a new ``layers.2`` beside the old one: ``layers.2#1``, verify
        OK). The holder is dumped under the name it has in the model now; one only under ``replaced``
        (the slot being filled: the hook runs before the assignment) or nowhere is leaving the model,
        and is not dumped any more."""
        holder = self._holders.pop(name, None)
        if holder is None:
            return
        model = self._model_ref()
        now = None
        if model is not None:
            for path, sub in named_modules(model):
                if sub is holder and (replaced is None or not _at_or_under(path, replaced)):
                    now = path
                    break
        if not self._unwrap_one(holder):
            self._holders[name] = holder  # someone wrapped over ours: it cannot be taken off (kept)
            return
        self._module_names.discard(name)
        if now is not None:
            self._free_name(now, replaced)  # (its holder left the model: a deleted layer, say)
        if now is not None and now not in self._holders:
            self._paths[holder] = now
            self._module_names.add(now)
            self._wrap(holder, self._capture_wrapper(now, holder.forward, _owner_of(holder)))
            self._holders[now] = holder

    def _unwrap_one(self, module) -> bool:
        """Take this Dumper's capture wrapper off ``module`` (False: another wrapper sits over it)."""
        for i, (m, wrapper) in enumerate(self._wrapped):
            if m is module:
                if module.__dict__.get("forward") is not wrapper:
                    return False
                _put_back(module, wrapper)
                if not _is_ours(module.__dict__.get("forward")):
                    _remove_copier(module)
                del self._wrapped[i]
                return True
        return False

    def _renumbered(self, container, before: dict) -> None:
        """``container`` (a ModuleList or Sequential) renumbered its modules without a registration
        (``insert``, ``del``, ``pop``: their ``_modules`` writes call no hook): ``before``, its
        modules then. A module inserted was never wrapped (its outputs missing, verify OK), and the
        ones after it, or after a deleted one, dumped under the number they had: names that now
        lead to another module. Each moved module's names follow its new number; an inserted one
        is wrapped (_adopt)."""
        try:
            prefix = self._paths.get(container)
        except TypeError:
            return
        if prefix is None or self._closed:
            return
        join = (lambda key: f"{prefix}.{key}") if prefix else (lambda key: key)
        old_key = {}
        for key, module in before.items():
            old_key.setdefault(id(module), key)
        # A module held at several numbers is named by its first, as at attach: its first number
        # before against its first now (not each later number it is also held at).
        new_key = {}
        for key, module in container._modules.items():
            if module is not None:
                new_key.setdefault(id(module), (key, module))
        moves, added = {}, []
        for key, module in new_key.values():
            was = old_key.get(id(module))
            if was is None:
                added.append((join(key), module))
            elif was != key:
                moves[join(was)] = join(key)

        self._rename(moves)
        for name, module in added:
            self._adopt(name, module, self._selection)
        kept = {id(m) for m in container._modules.values()}
        gone = [m for m in before.values() if m is not None and id(m) not in kept]
        if gone:
            self._removed(gone)

    def _rename(self, moves: dict) -> None:
        """Wrapped modules that the model now holds at another place: ``moves`` maps each old name
        to its new one (the names inside a moved module move with it). Each is dumped under its new
        name from now on."""
        if not moves:
            return

        def moved(name):  # (the most specific: a module's own move before its parent's)
            best = None
            for old in moves:
                if _at_or_under(name, old) and (best is None or len(old) > len(best)):
                    best = old
            return None if best is None else moves[best] + name[len(best):]

        for module, name in list(self._paths.items()):  # the names registrations inside them take
            if moved(name) is not None:
                self._paths[module] = moved(name)
        renamed = [(holder, moved(name)) for name, holder in list(self._holders.items()) if moved(name) is not None]
        for holder, _ in renamed:  # all off first: one's new name may be another's old one
            name = next(n for n, h in self._holders.items() if h is holder)
            if self._unwrap_one(holder):
                del self._holders[name]
                self._module_names.discard(name)
        for holder, name in renamed:
            if any(h is holder for h in self._holders.values()):
                continue  # (someone wrapped over ours: kept as it was)
            self._free_name(name, None)  # (a module deleted from that number)
            self._module_names.add(name)
            self._wrap(holder, self._capture_wrapper(name, holder.forward, _owner_of(holder)))
            self._holders[name] = holder

    def _replaced(self, old, new, name: str) -> None:
        """``new`` is about to take ``old``'s place ``name``: the wrapped modules of ``old`` that ``new``
        does not hold (a LoRA holds the module it wraps) leave the model with it, unless it holds them
        elsewhere (_free_name). They kept their wrappers and names: a pruned ``lm_head`` replaced by a
        module around a new Linear was still wrapped as ``lm_head``, a module the model no longer had."""
        staying = {id(sub) for sub in new.modules()}
        leaving = {id(sub) for sub in old.modules()} - staying
        for held, holder in list(self._holders.items()):
            if id(holder) in leaving and self._holders.get(held) is holder:
                self._free_name(held, name)
        # Their names leave _paths: a module put back elsewhere, or run outside the model, then given a
        # submodule had it wrapped under its old place's name (``block.extra`` for ``other.extra``,
        # verify OK). No walk of the model here (a quantization pass registers every Linear): one also
        # held elsewhere loses its name too, and what is registered in it later goes unfollowed, which
        # the check at close reports (verify fails), never dumped under a wrong name.
        for sub in old.modules():
            try:
                path = self._paths.get(sub) if id(sub) in leaving else None
            except TypeError:  # (unhashable: not in it)
                continue
            if path is not None and _at_or_under(path, name):
                del self._paths[sub]
        if id(old) not in staying:
            # Not a wrapper around ``old``: a container replaced by another that holds some of its
            # modules elsewhere (``model.layers = model.layers[2:]``, a reordered ModuleList). They
            # kept their old numbers, names that now lead to other modules or to none (layers.3
            # held the first layer's output, verify OK): each takes the name it has in ``new``.
            self._rename(_moves_within(old, new, name))

    def _removed(self, gone: list) -> None:
        """The modules ``gone`` left their place in the model (``delattr``, a ModuleDict's ``del``,
        ``pop``, ``clear``, a ModuleList's last one deleted): each wrapped module in them kept its
        wrapper and its old name, so run from outside the model it was dumped under a name that no
        longer leads to it, and put back elsewhere it kept that name. Each is dumped under the name
        the model has for it now, or not at all (_free_name); the names inside them are forgotten,
        so a module registered in one later is not dumped under its old place's name."""
        inside = {id(sub) for module in gone for sub in module.modules()}
        for name, holder in list(self._holders.items()):
            if id(holder) in inside and self._holders.get(name) is holder:
                self._free_name(name, None)
        self._forget_paths(inside)

    def _forget_paths(self, inside: set) -> None:
        """The modules of ids ``inside`` left their place: each keeps in ``_paths`` the name the
        model holds it under elsewhere, or none."""
        model = self._model_ref()
        if model is None:
            return
        held = _places(model)
        for module, name in list(self._paths.items()):
            if id(module) in inside:
                if id(module) in held:
                    self._paths[module] = held[id(module)][0]  # (still held under another name)
                else:
                    del self._paths[module]

    def _not_followed(self) -> list:
        """The model's tree against the wrappers, at close: ``"name: what"`` for each selected module
        in the model that no capture wrapper of this Dumper dumps, and each wrapped module the model
        no longer holds. Writes straight to a module's ``_modules`` (``torch.ao.quantization.convert``,
        ``swap_submodule``, ``del parent._modules[k]``) call no hook: such a module put in was never
        dumped, one taken out was dumped under a name that no longer leads to it, and verify said OK.
        One walk of the model, at close only (none per pass)."""
        model = self._model_ref() if getattr(self, "_holders", None) is not None else None
        if model is None:
            return []
        # Left out of the selection with what is in them: what attach left unwrapped with its subtree
        # (TorchScript, a name like a repeated call's, a shared module's left-out name). A module
        # whose forward is shadowed is not selected itself, but its submodules are dumped: one put in
        # there unseen is an unfollowed edit like any other.
        scripted = {name: why for name, why in self.not_wrapped.items() if why != _SHADOWED_REASON}
        held = _places(model)
        wrapped = {id(module) for module, wrapper in self._wrapped if getattr(wrapper, "_fastdump_name", None)
                   or getattr(wrapper, "__fastdump_name__", None)}
        found = []
        for name, module in select_modules(model, **self._selection, scripted=scripted):
            try:  # (one the Dumper saw put in is not an unseen edit: a container emptied since is a leaf now)
                seen = module in self._paths
            except TypeError:  # (unhashable: never followed, not judged)
                continue
            if not seen and id(module) not in wrapped:
                found.append(f"{name}: in the model and selected, not dumped (put in by a write to a "
                             "module's _modules, which no hook reports)")
        for name, module in self._holders.items():
            if id(module) not in held:
                found.append(f"{name}: wrapped, and the model no longer holds it (taken out by a write to a "
                             "module's _modules, which no hook reports): its calls since, if any, dumped under this name")
            elif not any(_at_or_under(path, name) for path in held[id(module)]):
                # Moved by a write to _modules (two modules' places swapped): its calls since were dumped
                # under its old name, which now leads to another module (or to none). (Under its old
                # place is no move: a LoRA-style wrapper set there holds it, and it keeps its name, _adopt.)
                found.append(f"{name}: wrapped, and the model holds it as {', '.join(sorted(held[id(module)]))} now "
                             "(moved by a write to a module's _modules, which no hook reports): its calls since, "
                             "if any, dumped under this name")
        return found


_RENUMBERING_FOLLOWERS: "weakref.WeakSet[Dumper]" = weakref.WeakSet()  # Dumpers following registrations


def _module_paths(model) -> "weakref.WeakKeyDictionary":
    """Each module of ``model`` -> its (first) name (Dumper._paths)."""
    paths = weakref.WeakKeyDictionary()
    for name, module in named_modules(model):
        try:
            paths.setdefault(module, name)
        except TypeError:  # unhashable (__eq__ without __hash__): its registrations go unseen
            pass
    return paths


def _places(model) -> "collections.defaultdict":
    """id of each module of ``model`` -> every name the model holds it under, in walk order (the
    first is the name ``named_modules`` gives it, as at attach)."""
    places = collections.defaultdict(list)
    for path, module in named_modules(model, remove_duplicate=False):
        places[id(module)].append(path)
    return places


def _at_or_under(path: str, name: str) -> bool:
    """``path`` is the module name ``name`` or a name inside it (``layers.1.mlp`` in ``layers.1``,
    never in ``layers.10``)."""
    return path == name or path.startswith(name + ".")


def _moves_within(old, new, prefix: str) -> dict:
    """Old name -> new name of each module under ``old`` that ``new``, taking its place ``prefix``,
    holds at another path (each module by its first path, as at attach)."""
    join = (lambda path: f"{prefix}.{path}" if path else prefix) if prefix else (lambda path: path)
    now = _places(new)
    moves = {}
    for path, sub in named_modules(old):
        if path and id(sub) in now and now[id(sub)][0] != path:
            moves[join(path)] = join(now[id(sub)][0])
    return moves


def _follow_renumbering(dumper) -> None:
    """Have ``dumper`` told of the edits torch's registration hook does not see: the ``insert`` and
    ``__delitem__`` (``del``, ``pop``) of ModuleList and Sequential and the ``__delitem__`` (``del``,
    ``pop``) and ``clear`` of ModuleDict write their ``_modules`` directly, as ``Module.__delattr__``
    does. These class methods are replaced once per process by ones that call the original, then
    tell each Dumper following (Dumper._renumbered); with none, only the call. (A direct write to
    ``_modules`` cannot be followed: the check at close finds it, _not_followed.)"""
    _RENUMBERING_FOLLOWERS.add(dumper)
    for cls, names in ((_torch.nn.ModuleList, ("insert", "__delitem__")), (_torch.nn.Sequential, ("insert", "__delitem__")),
                       (_torch.nn.ModuleDict, ("__delitem__", "clear"))):
        for name in names:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "__fastdump_renumbering__", False):
                setattr(cls, name, _telling_followers(method))
    delattr_ = _torch.nn.Module.__dict__.get("__delattr__")
    if delattr_ is not None and not getattr(delattr_, "__fastdump_renumbering__", False):
        _torch.nn.Module.__delattr__ = _telling_followers(delattr_, only_modules=True)


def _telling_followers(method, only_modules: bool = False):
    """``method`` of a module class, then each following Dumper told what it did to ``_modules``.
    ``only_modules``: ``__delattr__``, whose deletes of anything but a submodule (every ``del
    module.attr`` in the process) pass straight through, after one dict lookup."""
    @functools.wraps(method)
    def renumbering(container, *args, **kwargs):
        if only_modules:
            modules = container.__dict__.get("_modules")
            if not args or not isinstance(modules, dict) or args[0] not in modules:
                return method(container, *args, **kwargs)
        followers = [d for d in list(_RENUMBERING_FOLLOWERS) if not d._closed]
        if not followers:
            return method(container, *args, **kwargs)
        before = dict(container._modules)
        result = method(container, *args, **kwargs)
        for dumper in followers:
            try:
                with dumper._lock:  # (as the registration hook: not while close() takes wrappers off)
                    if not dumper._closed:
                        dumper._renumbered(container, before)
            except Exception as exc:  # never into the model: said
                log.warning("fastdump: %s: renumbering %s after attach: %s: %s", dumper.dir,
                            type(container).__name__, type(exc).__name__, _short(exc))
        return result

    renumbering.__fastdump_renumbering__ = True
    return renumbering
