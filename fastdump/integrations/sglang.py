"""SGLang drop-in: ``register_forward_hook_for_model`` with the signature of SGLang's
``sglang.srt.debug_utils.tensor_dump_forward_hook``, backed by fastdump.

Called as SGLang calls it: ``dump_dir`` ending in ``/draft`` or ``/target`` (SGLang's EAGLE split,
PR #21694) names the role, and the files land in ``<dump_dir>/TP.._PP.._Rank.._pid..`` as SGLang's
would; any other ``dump_dir`` is a single-role run, written to ``<dump_dir>/target/TP..``.
Differences from SGLang's own dumper are listed in docs/INTEGRATIONS.md; the main ones:
- passes are delimited by the model object passed in (``XxxForCausalLM``), so the logits of a
  forward land in the same pass as its layers (SGLang saves the pass when the inner ``model``
  returns, which pushes ``model``'s and ``logits_processor``'s outputs into the next pass file);
- tuple outputs are stored as ``name.0``, ``name.1`` ... and a second call of a module in one pass as
  ``name#1`` (``name#1.0`` ...), the top module and ``logits_processor`` included: they are watched
  by the Dumper (``Dumper.watch``) with the hooks below, which turn SGLang's output objects and the
  ForwardBatch into tensors; ``fastdump export --format sglang`` writes SGLang's names
  (``sglang_names.json`` in each rank directory lists the model's module names so the export can
  tell the two apart).

SGLang's ``TENSOR_DUMP_TOP_LEVEL_MODULE_NAME`` / ``TENSOR_DUMP_LAYERS_MODULE_NAME`` are honoured; a
hook variant's ``TENSOR_DUMP_MODE=all_io`` is refused (leaf modules only), its
``TENSOR_DUMP_LAST_TOKEN_ONLY`` said and not applied (docs/INTEGRATIONS.md, SGLang's variables).

``install()`` routes SGLang's ``--debug-tensor-dump-output-folder`` to this module; ``python -m
fastdump.integrations.sglang <launch_server args>`` does that in every SGLang process.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import torch

import fastdump
from fastdump import format as fmt
from fastdump.capture.selection import named_modules
from fastdump.fsutil import atomic_write_json

logger = logging.getLogger(__name__)

__all__ = ["register_forward_hook_for_model", "role_for", "install", "SGLangDumper", "NAMES_FILE"]

# Written into each rank directory: the module names of the dumped model, so an export can tell a
# tuple element (``qkv_proj.0``) from a child module (``experts.0``).
NAMES_FILE = fmt.NAMES_FILE
# The last component of dump_dir by which SGLang's model runner names a role (PR #21694).
_ROLE_DIRS = ("draft", "target")

# Speculative algorithms whose worker pair SGLang splits into draft/ and target/ (PR #21694) — its
# SpeculativeAlgorithm.is_eagle(). Any other algorithm with a draft worker gets the split too: two
# models in one process must never share a rank directory.
_EAGLE_FAMILY = {"EAGLE", "EAGLE3", "NEXTN", "FROZEN_KV_MTP"}


def role_for(is_draft_worker: bool, speculative_algorithm=None) -> str | None:
    """Role subdirectory SGLang's model runner uses: "draft"/"target" under speculative decoding, else None.

    ``speculative_algorithm`` may be a string ("EAGLE3"), SGLang's enum, or None."""
    if is_draft_worker:
        return "draft"
    algo = speculative_algorithm
    if algo is None:
        return None
    is_eagle = getattr(algo, "is_eagle", None)
    if callable(is_eagle):
        return "target" if is_eagle() else None
    name = str(getattr(algo, "name", algo)).upper()
    return "target" if name in _EAGLE_FAMILY else None


def _split_role(dump_dir: str) -> str | None:
    """The role SGLang's EAGLE split names by ``dump_dir``'s last component (``.../draft``,
    ``.../target``), or None for a single-role run's folder."""
    name = Path(dump_dir).name
    return name if name in _ROLE_DIRS else None


def _find_forward_batch(args, kwargs):
    fb = kwargs.get("forward_batch")
    if fb is None:  # positional: ForwardBatch is duck-typed so SGLang need not be importable
        fb = next((a for a in args if hasattr(a, "forward_mode") and hasattr(a, "input_ids")), None)
    return fb


# The ForwardBatch fields SGLang's hook dumps, as model.forward_batch_info.<field>.
_BATCH_FIELDS = ("input_ids", "seq_lens", "positions")


def _batch_info(dumper):
    """The top module's ``before`` hook (Dumper.watch): its ForwardBatch's tensors, taken before the
    forward runs (the values the model was called with), and the pass metadata."""
    def before(args, kwargs):
        fb = _find_forward_batch(args, kwargs)
        if fb is None:
            return None
        mode = getattr(fb, "forward_mode", None)
        bs = getattr(fb, "batch_size", None)
        if bs is None and isinstance(getattr(fb, "seq_lens", None), torch.Tensor):
            bs = fb.seq_lens.shape[0]
        meta = {"forward_mode": getattr(mode, "name", None) or str(mode), "batch_size": bs}
        if isinstance(getattr(fb, "input_ids", None), torch.Tensor):
            meta["num_tokens"] = fb.input_ids.shape[0]
        dumper.set_pass_meta(**meta)
        fields = {f: getattr(fb, f, None) for f in _BATCH_FIELDS}
        return {"forward_batch_info": {f: t for f, t in fields.items() if isinstance(t, torch.Tensor)}}

    return before


def _sglang_output(value):
    """The ``convert`` hook of ``model`` and ``logits_processor`` (Dumper.watch): SGLang's output
    objects as SGLang's hook stores them. A LogitsProcessorOutput is its ``next_token_logits``
    (stored under the module's name), PPProxyTensors its tensors as ``name.pp_proxy_tensors.<key>``;
    anything else (tensors, tuples) goes to fastdump's usual naming as returned."""
    if hasattr(value, "next_token_logits"):  # None in it: nothing (SGLang's hook dumps nothing else of it)
        logits = value.next_token_logits
        return logits if isinstance(logits, torch.Tensor) else None
    if isinstance(getattr(value, "tensors", None), dict):
        return {"pp_proxy_tensors": value.tensors}
    return value


class SGLangDumper:
    """What ``register_forward_hook_for_model`` returns (SGLang's TensorDumper face) over a fastdump Dumper."""

    def __init__(self, dumper, dump_dir: str):
        self.dumper = dumper
        self._dump_dir = dump_dir

    def get_dump_dir(self) -> str:
        """Where the files are, built as SGLang builds it: ``dump_dir`` as given joined with the rank
        directory (plus ``target`` for a single-role run, which fastdump keeps)."""
        return self._dump_dir

    def dump_current_tensors(self):
        """SGLang writes the pending pass file here. fastdump already ends each pass when the root
        module returns, so there is nothing pending after a forward; inside one (a nested call or a
        pass opened with ``dumper.begin_pass()``) this ends the open pass early. Called inside the
        model's forward it ends nothing of the forward's own pass (its later tensors would be lost
        while the pass read as whole); it used to loop there for ever, ``end_pass()`` doing nothing."""
        while self.dumper.in_pass and self.dumper.end_pass():
            pass

    def close(self) -> dict:
        """Flush, detach from the model (the Dumper unwraps everything it wrapped); the Dumper's stats."""
        return self.dumper.close()


# TENSOR_DUMP_MODE / mode=: a variant of SGLang's hook (a fork's tensor_dump_forward_hook.py, not
# sgl-project/sglang's, which has no mode) chooses ``leaf_outputs`` (what SGLang's hook dumps, and
# this drop-in) or ``all_io`` (every module's inputs and outputs, parents included). fastdump wraps
# leaf modules only, so ``all_io`` is refused rather than answered with a smaller dump.
_DUMP_MODES = ("leaf_outputs", "all_io")


def _check_dump_mode(mode) -> None:
    """Refuse a dump mode the drop-in does not dump: ``mode`` as passed, else TENSOR_DUMP_MODE."""
    if mode is None:
        mode = os.getenv("TENSOR_DUMP_MODE", "leaf_outputs")
    if mode == "leaf_outputs":
        return
    if mode == "all_io":
        raise ValueError("fastdump's SGLang drop-in dumps leaf module outputs only (TENSOR_DUMP_MODE=leaf_outputs): "
                         "all_io (every module's inputs and outputs) is not supported; unset TENSOR_DUMP_MODE "
                         "(FASTDUMP_INPUTS=1 adds the leaves' inputs)")
    raise ValueError(f"invalid tensor dump mode {mode!r} (TENSOR_DUMP_MODE); expected one of {list(_DUMP_MODES)}")


def _warn_last_token_only() -> None:
    """TENSOR_DUMP_LAST_TOKEN_ONLY=1 (the same variant) keeps each tensor's last row; fastdump keeps
    them whole, a superset: said once at registration, nothing is lost."""
    if os.getenv("TENSOR_DUMP_LAST_TOKEN_ONLY") == "1":
        logger.warning("fastdump: TENSOR_DUMP_LAST_TOKEN_ONLY=1 is not applied: whole tensors are dumped "
                       "(the variant's value is tensor[-1:] of a tensor of 2+ dims and 2+ rows)")


def register_forward_hook_for_model(model, dump_dir, dump_layers=None, tp_size=1, tp_rank=0, pp_rank=0,
                                    skip_passes=0, role=None, *, mode=None, **fastdump_kwargs) -> SGLangDumper:
    """Dump ``model`` (an SGLang ``XxxForCausalLM``) like SGLang's tensor-dump hook, via fastdump.

    ``dump_dir`` as SGLang's model runner passes it: ``<folder>/draft`` or ``<folder>/target`` under
    EAGLE (that component becomes the fastdump role, and ``fastdump.open(<folder>)`` finds both),
    else ``<folder>`` (role ``target``: files under ``<folder>/target/``). ``role`` given explicitly
    wins and keeps ``dump_dir`` as the root.

    Dumped: every leaf module, plus the top-level ``model`` child's output and its ForwardBatch
    (``model.forward_batch_info.{input_ids,seq_lens,positions}``); ``dump_layers`` keeps only those
    children of ``model.layers``. Pass metadata: forward_mode (ForwardMode name), batch_size,
    num_tokens. ``fastdump_kwargs`` go to ``fastdump.attach``. The top-level module name can be
    changed with SGLang's TENSOR_DUMP_TOP_LEVEL_MODULE_NAME / TENSOR_DUMP_LAYERS_MODULE_NAME variables.
    ``mode`` (else TENSOR_DUMP_MODE): ``leaf_outputs`` or unset; ``all_io`` or any other value is a
    ValueError, before the model is touched."""
    _check_dump_mode(mode)
    _warn_last_token_only()
    given = os.fspath(dump_dir)
    root, role_from_path = given, role is None and _split_role(given) is not None
    if role_from_path:
        root, role = str(Path(given).parent), _split_role(given)
    top_name = os.getenv("TENSOR_DUMP_TOP_LEVEL_MODULE_NAME", "model")
    layers_name = os.getenv("TENSOR_DUMP_LAYERS_MODULE_NAME", "layers")
    top = model._modules.get(top_name)
    if top is None:
        raise ValueError(f"model should have a module named {top_name!r} (set TENSOR_DUMP_TOP_LEVEL_MODULE_NAME)")
    skipped_layer = None
    if dump_layers is not None:
        # SGLang filters <top>.<layers>.N only (fastdump's layers= also takes a top-level layers.N):
        # a regex on exactly that layout.
        try:  # (an SGLang from before its layer list, PR #12691, passed one int: not a list to read)
            keep = "|".join(str(int(i)) for i in dump_layers)
        except (TypeError, ValueError):
            raise ValueError(f"dump_layers must be a list of layer indices (--debug-tensor-dump-layers 0 1 ...), "
                             f"not {dump_layers!r}") from None
        skipped_layer = rf"{re.escape(top_name)}\.{re.escape(layers_name)}\.(?!(?:{keep})(?:\.|$))\d+(\.|$)"
        dump_layers = None
    aliases, rescued = _shared_leaves(model, skipped_layer and re.compile(skipped_layer))
    if skipped_layer:
        # a shared leaf (SGLang's cached rotary_emb) whose first name is in a skipped layer is still
        # dumped when it also sits in a kept one, as SGLang's hook on that path does
        spare = "".join(f"(?!{re.escape(name)}$)" for name in rescued)
        fastdump_kwargs["exclude"] = _either(fastdump_kwargs.get("exclude"), f"^{spare}{skipped_layer}")
    # Left out of the leaf selection: the root (SGLang never dumps it; its output is the
    # LogitsProcessorOutput), and the modules watched with hooks below (a leaf top or a selected
    # logits_processor would be wrapped twice). A logits processor may sit below the root (a VL
    # model's `language_model.logits_processor`): SGLang's hook stores any module's
    # LogitsProcessorOutput as its logits, under that module's name.
    logits = _logits_processors(model)
    skip = [re.escape(fastdump_kwargs.get("root_name") or type(model).__name__), re.escape(top_name)]
    skip += [re.escape(name) for name in logits]
    fastdump_kwargs["exclude"] = _either(fastdump_kwargs.get("exclude"), "^(?:" + "|".join(skip) + ")$")
    # SGLang's signature has no pp_size; rank.json wants one.
    pp_size = fastdump_kwargs.pop("pp_size", None) or _sglang_pp_size() or pp_rank + 1
    dumper = fastdump.attach(model, root, role=role or "target", tp_rank=tp_rank, tp_size=tp_size,
                             pp_rank=pp_rank, pp_size=pp_size, layers=dump_layers, skip_passes=skip_passes,
                             **fastdump_kwargs)
    try:
        dumper.watch(top, top_name, convert=_sglang_output, before=_batch_info(dumper))
        for name, module in logits.items():
            if module is not top:
                dumper.watch(module, name, convert=_sglang_output)
    except BaseException:
        dumper.close()
        raise
    _write_module_names(dumper, model, top_name, aliases)
    # dumper.dir is <root>/<role>/<rank dir>, absolute: rebuild it from the path as given, like SGLang.
    where = os.path.join(given, dumper.dir.name) if role_from_path else \
        os.path.join(given, *dumper.dir.relative_to(dumper.root).parts)
    return SGLangDumper(dumper, where)


def _logits_processors(model) -> dict:
    """{qualified name: module} of the model's logits processors: modules named ``logits_processor``
    or of a class named ``LogitsProcessor``, at any depth (not inside another one)."""
    found = {}
    for name, module in named_modules(model):
        if name and (name.rpartition(".")[2] == "logits_processor" or type(module).__name__ == "LogitsProcessor") \
                and not any(name.startswith(outer + ".") for outer in found):
            found[name] = module
    return found


def _shared_leaves(model, skipped_layer):
    """A leaf module held under several names (SGLang's ``get_rope`` returns one cached
    ``rotary_emb`` for every layer) is wrapped once, under its first name; SGLang's hook is
    registered on every path to it, so each of its calls is stored under all of those names.
    Returns ({first name: [the names SGLang dumps it under, in hook order]}, [first names that
    ``skipped_layer`` matches while another of their names is kept])."""
    paths: dict = {}
    for name, module in named_modules(model, remove_duplicate=False):
        if name and next(module.children(), None) is None:
            paths.setdefault(id(module), []).append(name)
    aliases, rescued = {}, []
    for names in paths.values():
        if len(names) < 2:
            continue
        kept = [n for n in names if not (skipped_layer and skipped_layer.match(n))]
        if kept:
            aliases[names[0]] = kept
            if kept[0] != names[0]:
                rescued.append(names[0])
    return aliases, rescued


def _write_module_names(dumper, model, top_name: str, aliases: dict) -> None:
    """Record the model's module names next to the dump (see NAMES_FILE), and the names SGLang
    gives a shared leaf (see _shared_leaves). Best effort: a dump without it is exported with
    fastdump's names."""
    try:
        names = [name for name, _ in named_modules(model) if name]
        atomic_write_json(str(dumper.dir / NAMES_FILE), {"top": top_name, "modules": names, "aliases": aliases},
                          durable=False)
    except Exception as exc:  # never stop serving for this
        logger.warning("fastdump: cannot write %s in %s: %s", NAMES_FILE, dumper.dir, exc)


def _sglang_pp_size() -> int | None:
    """The pipeline-parallel size from SGLang's process groups, when SGLang runs here (else None,
    and the caller falls back to pp_rank + 1, a lower bound)."""
    ps = sys.modules.get("sglang.srt.distributed.parallel_state")
    try:
        return int(ps.get_pp_group().world_size) if ps is not None else None
    except Exception:
        return None


def _either(a, b: str):
    """The caller's exclude= (a str, a compiled pattern or a list of them) and one more pattern, as a
    list: options joins the items itself (a list or a compiled pattern formatted into a str is a
    different, wrong pattern)."""
    if a is None or (isinstance(a, str) and not a):
        return b
    return [*a, b] if isinstance(a, (list, tuple, set, frozenset)) else [a, b]


# --- routing SGLang's --debug-tensor-dump-output-folder to fastdump ---

_SGLANG_SOURCE = "sglang.srt.debug_utils.tensor_dump_forward_hook"  # where SGLang defines the function
# Modules that call it, having imported it by name: model_runner (SGLang <= 0.5.18), then
# load_model_utils.maybe_register_debug_tensor_dump_hook (>= 0.5.19).
_SGLANG_CALL_SITES = (
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.model_runner_components.load_model_utils",
)
_HOOK_NAME = "register_forward_hook_for_model"


# The parameters (after ``model``) of the SGLang function install() replaced, in its order: its call
# sites pass them by position, and the order changed between SGLang versions (before
# --debug-tensor-dump-layers: ``(model, dump_dir, tp_size, tp_rank, pp_rank)``, which read by today's
# order made tp_size the dump_layers and failed the model's load). install() reads them from the
# function it replaces; today's order when it could not.
_HOOK_PARAMS = ("dump_dir", "dump_layers", "tp_size", "tp_rank", "pp_rank")
_sglang_params = _HOOK_PARAMS


def _replaced_params(original) -> tuple:
    """The positional parameter names after ``model`` of SGLang's function, or today's order."""
    import inspect

    try:
        params = list(inspect.signature(original).parameters.values())
    except (TypeError, ValueError):
        return _HOOK_PARAMS
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in params[1:] if p.kind in kinds)
    return names if names[:1] == ("dump_dir",) else _HOOK_PARAMS


def _sglang_entry(model, *args, **kwargs):
    """Replacement installed into SGLang: its call, with FASTDUMP_* settings where SGLang's flags are
    silent. The arguments are read by the replaced function's parameter names (``_sglang_params``).
    The role comes from ``dump_dir`` exactly as in the public function (one code path). A parameter
    ``mode`` (or a seventh argument) is the dump mode of the TENSOR_DUMP_MODE variant (checked there)."""
    given = dict(zip(_sglang_params, args))
    args = args[len(_sglang_params):]
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise TypeError(f"register_forward_hook_for_model() got multiple values for {twice}")
    given.update(kwargs)
    dump_dir = given.pop("dump_dir")
    dump_layers = given.pop("dump_layers", None)
    tp_size, tp_rank, pp_rank = given.pop("tp_size", 1), given.pop("tp_rank", 0), given.pop("pp_rank", 0)
    mode = given.pop("mode", None)
    skip_passes = given.pop("skip_passes", None)  # (a hook variant's: the warm-up passes it leaves out)
    if args and (args[0] is None or isinstance(args[0], str)):
        mode, args = args[0], args[1:]
    if args or given:
        logger.warning("fastdump: ignoring SGLang tensor-dump options it does not implement: %s %s", args, given)
    from fastdump import config

    settings = config.parse_env(os.environ)
    for k in ("root", "tp_rank", "tp_size", "pp_rank"):  # SGLang's own values win
        settings.pop(k, None)
    role = settings.pop("role", None)
    if _split_role(os.fspath(dump_dir)) is not None:
        role = None  # SGLang's EAGLE split decides; FASTDUMP_ROLE applies to a single-role run only
    layers = settings.pop("layers", None)
    if skip_passes:  # (0, its default, leaves FASTDUMP_SKIP in force)
        settings["skip_passes"] = skip_passes
    return register_forward_hook_for_model(model, dump_dir, layers if dump_layers is None else dump_layers,
                                           tp_size, tp_rank, pp_rank, role=role, mode=mode, **settings)


def install() -> bool:
    """Make SGLang's tensor-dump flag use fastdump in this process. False (and no change) without SGLang.

    Replaces the function in SGLang's defining module first, so every module that imports it by
    name afterwards gets fastdump's; then in every already-imported module still holding SGLang's
    original. Returns True only once each known call site that exists in this SGLang holds
    fastdump's function (an SGLang whose call site cannot be patched raises RuntimeError rather than
    dumping with SGLang's own hook). SGLang runs its model in spawned scheduler processes: use
    ``python -m fastdump.integrations.sglang`` (below) to have this run in each of them."""
    try:
        source = __import__(_SGLANG_SOURCE, fromlist=["_"])
    except Exception:  # absent, or an SGLang whose import fails here (no GPU build...): leave it alone
        return False
    original = getattr(source, _HOOK_NAME, None)
    if original is None:
        return False
    patched = []
    if original is not _sglang_entry:
        global _sglang_params
        _sglang_params = _replaced_params(original)
        setattr(source, _HOOK_NAME, _sglang_entry)
        patched.append(_SGLANG_SOURCE)
    for name in _SGLANG_CALL_SITES:  # imported now, they bind fastdump's; imported earlier, patched below
        try:
            __import__(name, fromlist=["_"])
        except Exception as exc:  # absent in this SGLang version, or not importable here
            logger.debug("fastdump: %s not importable (%s)", name, exc)
    for name, mod in list(sys.modules.items()):
        if name.startswith("sglang.") and mod is not None and \
                mod.__dict__.get(_HOOK_NAME) is original and original is not _sglang_entry:
            mod.__dict__[_HOOK_NAME] = _sglang_entry
            patched.append(name)
    missed = [name for name in _SGLANG_CALL_SITES
              if name in sys.modules and _HOOK_NAME in vars(sys.modules[name])
              and vars(sys.modules[name])[_HOOK_NAME] is not _sglang_entry]
    if missed:
        raise RuntimeError(f"fastdump: SGLang's {_HOOK_NAME} is still in use in {missed}")
    sites = [name for name in _SGLANG_CALL_SITES if name in sys.modules and _HOOK_NAME in vars(sys.modules[name])]
    logger.info("fastdump: SGLang tensor dumping routed to fastdump (patched: %s; call sites: %s)",
                ", ".join(patched) or "already installed", ", ".join(sites) or "none imported")
    return True


def main(argv=None) -> int:
    """``python -m fastdump.integrations.sglang <sglang.launch_server arguments>``."""
    if not install():
        print("fastdump: SGLang is not importable here", file=sys.stderr)
        return 2
    import runpy

    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    # alter_sys=False keeps this module as __main__, so SGLang's spawned processes re-import it as
    # __mp_main__ and run install() below before they build their model runner.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":
    install()
