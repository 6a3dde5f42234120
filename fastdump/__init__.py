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
    """Start dumping ``model`` (or, with ``model=None``, only what ``Dumper.dump`` is given).

    Writes ``<root>/<role>/TP{tp}_PP{pp}_Rank{rank}_pid{pid}_{session}/``. Ranks (tp_rank, tp_size,
    pp_rank, pp_size, dp_*, ep_*) default from torch.distributed, then from RANK/WORLD_SIZE-style
    variables. Every option, its default and its FASTDUMP_* variable: ``fastdump.options.Options``
    (and README). A bad option raises before the model is touched.
    """
    from .capture import Dumper, resolve_ranks
    from .options import Options, check_option_names

    check_option_names("attach", options)
    opts = Options(root=root, **options)
    return Dumper(model, opts, ranks=resolve_ranks(**opts.rank_args))


def open(root):  # noqa: A001 - mirrors h5py.File / safetensors' naming
    """Read a dump: ``fastdump.open(root).load(role, rank, pass_id) -> dict[str, Tensor]``.

    ``root`` may be a list of roots (one per host of a multi-node run): read as one dump."""
    from .multiroot import open as _open

    return _open(root)


def diff(baseline, target, **options):
    """Compare two dumps -> ``DiffResult`` (``.ok``, ``.first_divergence``, ``.rows``, ``.to_json()``,
    ``.to_html(path)``). Options as ``fastdump diff`` (see ``fastdump.compare.diff``)."""
    from .compare import diff as _diff

    return _diff(baseline, target, **options)


def maybe_attach(model, role=None, **overrides):
    """Attach when FASTDUMP_DIR is set (the profiling flag); otherwise return None at once."""
    from .config import maybe_attach as _maybe_attach

    return _maybe_attach(model, role=role, **overrides)


def __getattr__(name):
    if name == "Dumper":
        from .capture import Dumper

        return Dumper
    raise AttributeError(name)
