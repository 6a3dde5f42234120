"""The ``fastdump`` command line: ``main`` (argument parsing, subcommands) and ``dump`` (ls, verify,
show on a dump). ``python -m fastdump`` runs ``main``."""

from .main import main

__all__ = ["main"]
