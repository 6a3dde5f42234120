"""The serving side, first stage of the data flow: pick modules, wrap their forward, group calls
into passes, hand each tensor to the staging channel (``fastdump.staging``).

``dumper`` holds the ``Dumper`` (attach / detach / passes / manifest); see docs/INTERNALS.md.
"""

from .dumper import Dumper, close_all, resolve_ranks, select_modules

__all__ = ["Dumper", "close_all", "resolve_ranks", "select_modules"]
