"""fastdump: dump a served model's activations to HDF5 with low overhead.

    dumper = fastdump.attach(model, "/tmp/dump", role="target")   # every leaf module + the root
    ...                                                            # serve as usual
    dumper.close()                                                 # flush, wait for the writer
    ds = fastdump.open("/tmp/dump"); ds.load("target", 0, pass_id=3)
"""

from __future__ import annotations

from ._version import __version__

__all__ = ["attach", "open", "diff", "maybe_attach", "Dumper", "__version__"]


def attach(model, root, **options):
    """Start dumping ``model`` (or, with ``model=None``, only what ``Dumper.dump`` is given) and
    return its ``Dumper`` (a context manager; ``close()`` flushes and waits for the disk).

    Every leaf module and the root are dumped, each root forward being one pass, into
    ``<root>/<role>/TP{tp}_PP{pp}_Rank{rank}_pid{pid}_{session}/``. Options (keyword only; each
    one's default and check is a field of ``fastdump.options.Options``, README "Use" has the
    table): ``role`` ("target"); ranks ``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``,
    ``dp_*``, ``ep_*`` (default: torch.distributed, then RANK/WORLD_SIZE); the selection
    ``layers``, ``include``, ``exclude``, ``module_types``, ``inputs``; which passes
    ``skip_passes``, ``every``, ``pass_range``, ``max_bytes``, ``pass_meta``, ``root_passes``,
    ``root_name``; the staging ``policy``, ``block_timeout_s``, ``writer``,
    ``writer_priority``, ``ring_mb``, ``device_ring_mb``, ``cuda_graphs``, ``graph_ring_mb``,
    ``device``; the segments ``segment_passes``, ``segment_mb``, ``segment_seconds``,
    ``segment_idle_seconds``; ``strict``. ``FASTDUMP_*`` variables are not read here (see
    ``maybe_attach``).

    Raises, before the model is touched: ``TypeError`` for an unknown option (naming the closest
    one), ``ValueError`` for a bad value or ranks it cannot tell (and for a TorchScript model).
    Dumping that cannot start (an unwritable root, a writer that fails to start or does not answer
    within ``block_timeout_s``, modules that cannot be wrapped) is not raised: the reason is logged
    and recorded (``stats()["error"]``, rank.json or producer_error.json) and the model serves
    undumped. ``strict=True`` raises instead where the root, the writer's start or the wrapping
    fails.
    """
    from .capture import Dumper, resolve_ranks
    from .options import Options, check_option_names

    check_option_names("attach", options)
    opts = Options(root=root, **options)
    return Dumper(model, opts, ranks=resolve_ranks(**opts.rank_args))


def open(root):  # noqa: A001 - mirrors h5py.File / safetensors' naming
    """Read a dump -> ``DumpSet``: ``roles``, ``ranks(role)``, ``passes(role, rank)``,
    ``load(role, rank, pass_id, check=False) -> {name: tensor}``, ``series``, ``meta``,
    ``structure``, ``problems``; a context manager (``close()`` closes its files).

    ``root`` is the directory given to ``attach``, or a list of them (one per host of a multi-node
    run), read as one dump. Nothing in a dump runs code. Raises ``FileNotFoundError`` for a
    missing root; the reading methods raise ``KeyError`` for a role, rank or pass not there
    (naming those that are), ``ValueError`` when a rank number is ambiguous (several sessions:
    give the directory name or ``session=``), and ``fastdump.reader.DumpError`` (a ValueError)
    for damaged or unsafe data (``check=True`` also verifies each tensor's CRC32C)."""
    from .multiroot import open as _open

    return _open(root)


def diff(baseline, target, **options):
    """Compare ``target`` against ``baseline`` (roots, lists of roots, or open DumpSets) tensor by
    tensor -> ``DiffResult`` (``.ok``, ``.first_divergence``, ``.rows``, ``.to_json()``,
    ``.to_html(path)``).

    Options, as ``fastdump diff``'s flags: ``role``, ``rank``, ``passes`` ("0-3,7"), ``name``
    (regex), ``atol``, ``rtol`` (1e-5 each), ``tol``, ``metric``, ``align``, ``unshard``,
    ``allow_running``, ``strict`` (details: ``fastdump.compare.diff``). Raises ``TypeError`` for
    an unknown option, ``ValueError`` for a bad value and ``fastdump.compare.DiffError`` when the
    dumps cannot be compared at all; a tensor that differs or is missing is a row of the result."""
    from .compare import diff as _diff

    return _diff(baseline, target, **options)


def maybe_attach(model, role=None, **overrides):
    """``attach`` when ``FASTDUMP_DIR`` is set (the profiling flag); otherwise return None at once
    (the model is not touched).

    The options come from the ``FASTDUMP_*`` variables (``fastdump info`` lists them), then from
    ``role`` and ``overrides`` (``attach``'s keywords), which win. Raises
    ``fastdump.config.ConfigError`` (a ValueError) naming a variable whose value is invalid,
    ``TypeError`` for an unknown keyword (also when ``FASTDUMP_DIR`` is unset), and what ``attach``
    raises."""
    from .config import maybe_attach as _maybe_attach

    return _maybe_attach(model, role=role, **overrides)


def __getattr__(name):
    if name == "Dumper":
        from .capture import Dumper

        return Dumper
    raise AttributeError(name)
