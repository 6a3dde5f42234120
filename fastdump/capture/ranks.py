"""A Dumper's ranks: as given, else from torch.distributed, else from launcher variables; numbered
as SGLang numbers them, so rank directories line up with SGLang's (``fastdump.format`` names them)."""

from __future__ import annotations

import os

from ..format import check_rank_numbers
from ..options import _check_int


def _env_int(*names: str):
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    return None


def resolve_ranks(tp_rank=None, tp_size=None, pp_rank=None, pp_size=None, dp_rank=None, dp_size=None,
                  ep_rank=None, ep_size=None) -> dict:
    """Ranks as given, else from torch.distributed, else from RANK/WORLD_SIZE-style variables."""
    dist_rank = dist_size = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist_rank, dist_size = dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    if tp_rank is None:
        tp_rank = dist_rank if dist_rank is not None else _env_int("TP_RANK", "RANK", "LOCAL_RANK")
    if tp_size is None:
        tp_size = dist_size if dist_size is not None else _env_int("TP_SIZE", "WORLD_SIZE")
    for key, value in (("tp_rank", tp_rank), ("tp_size", tp_size), ("pp_rank", pp_rank), ("pp_size", pp_size),
                       ("dp_rank", dp_rank), ("dp_size", dp_size), ("ep_rank", ep_rank), ("ep_size", ep_size)):
        if value is not None:
            _check_int(key, value, 1 if key.endswith("_size") else 0)
    ranks = {
        "tp_rank": tp_rank or 0, "tp_size": tp_size or 1,
        "pp_rank": pp_rank or 0, "pp_size": pp_size or 1,
        "dp_rank": dp_rank or 0, "dp_size": dp_size or 1,
        "ep_rank": ep_rank or 0, "ep_size": ep_size or 1,
    }
    for key in ("tp", "pp", "dp", "ep"):
        if not 0 <= ranks[f"{key}_rank"] < ranks[f"{key}_size"]:
            raise ValueError(f"{key}_rank={ranks[f'{key}_rank']} is outside {key}_size={ranks[f'{key}_size']}")
    # SGLang's numbering, so dumps line up with SGLang's own directories.
    ranks["rank"] = ranks["tp_size"] * ranks["pp_rank"] + ranks["tp_rank"]
    return check_rank_numbers(ranks)  # (sizes beyond what diff and export accept: refused here already)
