"""A Dumper's ranks: as given, else from torch.distributed, else from launcher variables; numbered
as SGLang numbers them, so rank directories line up with SGLang's (``fastdump.format`` names them)."""

from __future__ import annotations

import os

from ..format import check_rank_numbers
from ..options import _check_int


def _env_int(minimum: int, *names: str):
    """(name, value) of the first of ``names`` set, else (None, None)."""
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                number = int(value)
            except ValueError:
                number = None
            if number is None or number < minimum:
                raise ValueError(f"{name}={value!r} is not an integer >= {minimum}")
            return name, number
    return None, None


def _dist_world():
    """(rank, size, where from) of torch.distributed's world, or None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), "torch.distributed's world"
    except Exception:
        pass
    return None


def _env_local_world(local: int):
    """(rank, size, where from) of a LOCAL_RANK set without RANK, or None. LOCAL_RANK numbers one
    node's processes: it is a world rank only where the node is the whole world (LOCAL_WORLD_SIZE,
    and WORLD_SIZE equal to it or unset); taken with a WORLD_SIZE of several nodes, each node's
    LOCAL_RANK=1 claimed the same TP rank and their data met in one rank directory."""
    _, local_size = _env_int(1, "LOCAL_WORLD_SIZE")
    _, size = _env_int(1, "WORLD_SIZE")
    if local_size is None and size == 1:  # a world of one process is one node
        local_size = 1
    if local_size is None and size is None:
        if local:  # a rank of a world of unknown size: any TP size would be a guess
            raise ValueError(f"LOCAL_RANK={local} is set but RANK, WORLD_SIZE and LOCAL_WORLD_SIZE are not: set "
                             "RANK and WORLD_SIZE, or give tp_rank= and tp_size=")
        return None
    if local_size is None or (size is not None and size != local_size):
        local_size_text = "LOCAL_WORLD_SIZE is not set" if local_size is None else f"LOCAL_WORLD_SIZE={local_size}"
        raise ValueError(f"LOCAL_RANK={local} is set without RANK, with WORLD_SIZE={size} and {local_size_text}: "
                         "LOCAL_RANK numbers one node's processes, and which of several nodes this is cannot be "
                         "told; set RANK (torchrun does), or give tp_rank= and tp_size=")
    if local >= local_size:
        raise ValueError(f"LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_size}")
    return local, local_size, "the launcher's one-node world (LOCAL_RANK/LOCAL_WORLD_SIZE)"


def _env_world():
    """(rank, size, where from) of the launcher's RANK and WORLD_SIZE (RANK wins over LOCAL_RANK),
    or of a one-node LOCAL_RANK, or None."""
    _, rank = _env_int(0, "RANK")
    if rank is None:
        _, local = _env_int(0, "LOCAL_RANK")
        if local is not None:
            return _env_local_world(local)
    _, size = _env_int(1, "WORLD_SIZE")
    if size is None:
        if rank:  # a rank of a world of unknown size: any TP size would be a guess
            raise ValueError(f"RANK={rank} is set but WORLD_SIZE is not: set both, or give tp_rank= and tp_size=")
        return None
    if rank is None:
        if size > 1:  # every process would be rank 0
            raise ValueError(f"WORLD_SIZE={size} is set but RANK is not: set both, or give tp_rank= and tp_size=")
        rank = 0
    if rank >= size:
        raise ValueError(f"RANK={rank} is not below WORLD_SIZE={size}")
    return rank, size, "the launcher's world (RANK/WORLD_SIZE)"


def _tp_from_world(world, tp_rank, tp_size, pp_rank, pp, dp):
    """The TP rank and size a rank of ``world`` has, given the other sizes. TP ranks are the
    world's innermost (SGLang's rank = tp_size * pp_rank + tp_rank; Megatron and torchrun alike);
    whatever the sizes leave ambiguous is a ValueError, never a guess: the world rank taken whole
    as the TP rank gave a PP stage or a DP replica the directory of another TP rank."""
    w_rank, w_size, where = world
    tp_rank_given = tp_rank is not None
    if tp_size is None:
        if dp > 1:  # a world of one replica (SGLang) or of all of them (torchrun): cannot tell
            raise ValueError(f"dp_size={dp} without tp_size: {where} of {w_size} processes cannot tell TP ranks "
                             "from DP replicas; give tp_size= (and tp_rank=)")
        if w_size % pp:
            raise ValueError(f"pp_size={pp} does not divide {where} of {w_size} processes; give tp_size= and tp_rank=")
        tp_size = w_size // pp
    if tp_rank is None:
        if w_size not in (tp_size * pp, tp_size * pp * dp):
            with_dp = (" (* dp_size)", f" (* {dp})") if dp > 1 else ("", "")
            sizes = f"tp_size * pp_size{with_dp[0]} = {tp_size} * {pp}{with_dp[1]}"
            raise ValueError(f"{where} of {w_size} processes is not {sizes}; give tp_rank= (and the other ranks)")
        tp_rank = w_rank % tp_size
    if w_size == tp_size * pp:  # the world is one replica: its rank is SGLang's rank
        if pp_rank is None:
            pp_rank = w_rank // tp_size
        elif pp_rank != w_rank // tp_size and not tp_rank_given:
            raise ValueError(f"pp_rank={pp_rank} disagrees with rank {w_rank} of {where} (rank = tp_size * pp_rank "
                             f"+ tp_rank makes it pp_rank {w_rank // tp_size} with tp_size={tp_size}); "
                             "give tp_rank= too")
    elif pp_rank is None and pp > 1:  # every stage would be stage 0
        raise ValueError(f"pp_size={pp} without pp_rank: {where} of {w_size} processes is not tp_size * pp_size "
                         f"= {tp_size} * {pp}; give pp_rank=")
    return tp_rank, tp_size, pp_rank


def resolve_ranks(tp_rank=None, tp_size=None, pp_rank=None, pp_size=None, dp_rank=None, dp_size=None,
                  ep_rank=None, ep_size=None) -> dict:
    """Ranks as given, else from torch.distributed, else from RANK/WORLD_SIZE-style variables."""
    for key, value in (("tp_rank", tp_rank), ("tp_size", tp_size), ("pp_rank", pp_rank), ("pp_size", pp_size),
                       ("dp_rank", dp_rank), ("dp_size", dp_size), ("ep_rank", ep_rank), ("ep_size", ep_size)):
        if value is not None:
            _check_int(key, value, 1 if key.endswith("_size") else 0)
    def missing():
        return tp_rank is None or tp_size is None or (pp_rank is None and (pp_size or 1) > 1)

    world = None
    if missing():
        world = _dist_world()
        if world is None:  # no torch.distributed: TP_RANK/TP_SIZE as some launchers set them, then RANK/WORLD_SIZE
            tp_rank = tp_rank if tp_rank is not None else _env_int(0, "TP_RANK")[1]
            tp_size = tp_size if tp_size is not None else _env_int(1, "TP_SIZE")[1]
            world = _env_world() if missing() else None
    if world is not None:
        tp_rank, tp_size, pp_rank = _tp_from_world(world, tp_rank, tp_size, pp_rank, pp_size or 1, dp_size or 1)
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
