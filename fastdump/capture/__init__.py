"""The serving side, first stage of the data flow: pick modules, wrap their forward, group calls
into passes, hand each tensor to the staging channel (``fastdump.staging``).

``dumper`` holds the ``Dumper`` (attach and its public API), whose methods live in one module
per job (``passes``, ``emit``, ``wrappers``, ``following``, ``outside_passes``, ``closing``);
see docs/INTERNALS.md.
"""

from .dumper import Dumper, close_all, resolve_ranks
from .selection import select_modules

__all__ = ["Dumper", "close_all", "resolve_ranks", "select_modules"]
