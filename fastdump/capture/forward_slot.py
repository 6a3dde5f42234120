"""A module's instance ``forward`` slot: which wrappers are ours, what each wraps, putting
back what it wrapped, and copies of a wrapped module (``copy.deepcopy``, DataParallel's
replicas, ``pickle``) made without our wrappers.

A helper of the Dumper's modules (fastdump/capture/dumper.py); see docs/INTERNALS.md.
"""

from __future__ import annotations

import copy
import types
import weakref

from .structure import _MISSING


# Every wrapper a Dumper put on a module, weakly: "ours" is decided by identity, since
# functools.wraps copies a wrapper's __dict__ (our marks included) into whatever wraps it.
_OURS = weakref.WeakSet()


def _mark_ours(wrapper, previous) -> None:
    """Remember what ``wrapper`` wraps: the module's instance forward before it (_MISSING: none)."""
    wrapper.__fastdump_previous__ = previous
    _OURS.add(wrapper)


def _is_ours(forward) -> bool:
    try:
        return forward in _OURS
    except TypeError:  # (an unhashable callable someone put there)
        return False


def _wrapped_by(forward):
    """What our wrapper ``forward`` wraps (_MISSING: the class's forward)."""
    return forward.__dict__.get("__fastdump_previous__", _MISSING)


def _put_back(module, wrapper) -> None:
    """Take ``wrapper``, ours and ``module``'s forward now, off: what it wraps goes back (the
    pass-through wrappers of Dumpers closed earlier skipped, _skip_stale), or nothing where the
    module had no forward of its own."""
    previous = _skip_stale(_wrapped_by(wrapper))
    if previous is _MISSING:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = previous


def _skip_stale(forward):
    """What a closing Dumper puts back: ``forward``, or, when that is the pass-through wrapper of a
    Dumper closed earlier (attach A, attach B, close A, close B), what that wrapper wrapped. Without
    this, every such attach/close cycle left one more dead wrapper on the module (and kept its closed
    Dumper alive through it)."""
    while _is_ours(forward) and forward.__dict__.get("__fastdump_off__"):
        forward = _wrapped_by(forward)
    return forward


def _deepcopy_undumped(module, memo):
    """``copy.deepcopy`` of a module a Dumper wraps (installed as the instance's ``__deepcopy__``).

    A wrapper calls the forward bound to the module it was made for, and deepcopy copies functions
    as they are: the copy would run the original module, with the original's weights, and go on
    doing so after the Dumper closed. So the copy is made without our wrappers: it gets what they
    wrap (the class's forward, or the instance forward someone set before us) and is not dumped."""
    # A module reduces to (cls, args, its __dict__) through object.__reduce_ex__, or to (cls, args)
    # through a __reduce__ of its own (OptimizedModule); other forms are refused, loudly.
    reduced = type(module).__reduce_ex__(module, 4)
    state = reduced[2] if len(reduced) > 2 else None
    if any(x is not None for x in reduced[3:]) or not (state is None or isinstance(state, dict)):
        raise TypeError(f"fastdump: cannot deep-copy {type(module).__name__} while a Dumper wraps it "
                        "(close the Dumper first)")
    copied = reduced[0](*copy.deepcopy(reduced[1], memo))
    memo[id(module)] = copied
    if state is not None:
        state = dict(state)
        _undumped_state(state)
        state = copy.deepcopy(state, memo)
        if hasattr(copied, "__setstate__"):  # nn.Module's; watch() also takes other objects
            copied.__setstate__(state)
        else:
            copied.__dict__.update(state)
    return copied


def _replicate_undumped(module):
    """``nn.Module._replicate_for_data_parallel`` of a module a Dumper wraps (installed on the
    instance, as ``__deepcopy__`` is). DataParallel's replicate() gives each replica a copy of the
    module's ``__dict__``, our wrapper included, which calls the forward of the module it was made
    for: every replica computed with the original's weights, on the original's device. A replica
    gets what our wrappers wrap instead and is not dumped: DataParallel runs its replicas in one
    thread per device at once, and their calls in one pass would be mixed (docs/INTERNALS.md)."""
    replica = type(module)._replicate_for_data_parallel(module)
    _undumped_state(replica.__dict__)
    return replica


def _getstate_undumped(module):
    """``__getstate__`` of a module a Dumper wraps (installed on the instance, as ``__deepcopy__`` is):
    what ``pickle`` and ``torch.save`` store. Our wrappers cannot be pickled (the C one is no Python
    function, the Python ones are closures), so pickling a wrapped model raised; and a wrapper that
    could be would call the forward of the module it was made for. The state stored is the module's
    without our wrappers and copiers, so what is loaded back is a model nothing dumps."""
    getstate = getattr(type(module), "__getstate__", None)  # nn.Module's (object's from Python 3.11)
    state = module.__dict__ if getstate is None else getstate(module)
    if not isinstance(state, dict):
        raise TypeError(f"fastdump: cannot pickle {type(module).__name__} while a Dumper wraps it "
                        "(close the Dumper first)")
    state = dict(state)
    _undumped_state(state)
    return state


_COPIERS = {"__deepcopy__": _deepcopy_undumped, "_replicate_for_data_parallel": _replicate_undumped,
            "__getstate__": _getstate_undumped}


def _undumped_state(state: dict) -> None:
    """A copy of a wrapped module's ``__dict__``, made the state of a module nothing dumps: our
    wrappers give way to what they wrap (the class's forward, or an instance forward set before
    us), and our copiers go."""
    for attr, copier in _COPIERS.items():
        if getattr(state.get(attr), "__func__", None) is copier:
            del state[attr]
    forward = state.pop("forward", _MISSING)
    while _is_ours(forward):
        forward = _wrapped_by(forward)
    if forward is not _MISSING:
        state["forward"] = forward


def _install_copier(module) -> None:
    """Give ``module`` our copiers: _deepcopy_undumped unless it or its class has a ``__deepcopy__``
    of its own; _replicate_undumped when its class replicates for DataParallel (every nn.Module);
    _getstate_undumped (pickle), which wraps the class's ``__getstate__``."""
    cls, own = type(module), module.__dict__
    if "__deepcopy__" not in own and getattr(cls, "__deepcopy__", None) is None:
        own["__deepcopy__"] = types.MethodType(_deepcopy_undumped, module)
    if "_replicate_for_data_parallel" not in own and callable(getattr(cls, "_replicate_for_data_parallel", None)):
        own["_replicate_for_data_parallel"] = types.MethodType(_replicate_undumped, module)
    if "__getstate__" not in own:
        own["__getstate__"] = types.MethodType(_getstate_undumped, module)


def _remove_copier(module) -> None:
    for attr, copier in _COPIERS.items():
        if getattr(module.__dict__.get(attr), "__func__", None) is copier:
            del module.__dict__[attr]
