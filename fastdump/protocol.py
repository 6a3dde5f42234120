"""The wire protocol between the serving process and the writer, shared by both sides.

Two kinds of ring record (see docs/INTERNALS.md, "Ring protocol"): tensor records and control
records. A control record's payload is one JSON object built by a constructor below, so every
message the writer can receive is defined here, with its fields; INTERNALS' control-message table
is checked against ``MESSAGES`` (tests/test_protocol.py). ``Record`` names the fields of one item of
``_C.Consumer.next_batch``. One exception: the CUDA-graph drain thread (csrc/cuda_graph_record.cu,
``pass_json``) writes a replay's ``begin`` and ``end`` itself, without the GIL, with the fields
declared here (its ``meta`` carries ``graph_replay``).

Base layer: no torch, no h5py; imported by the staging engine, the Dumper and the writer process.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple


class Record(NamedTuple):
    """One item of ``Consumer.next_batch``, in the order the extension returns it. The writer's hot
    loop unpacks items positionally in this order (a tuple unpack costs nothing per record)."""
    kind: int  # _C.KIND_TENSOR or _C.KIND_CONTROL
    channel: int  # the Dumper's channel (one role/rank directory)
    name_id: int  # interned tensor name (a ``name`` message came first)
    pass_id: int
    dtype: int  # fastdump.dtypes code
    shape: tuple
    payload: Any  # tensor bytes (a read-only ring view) or the control message's JSON
    seq: int  # control records: the sequence number ``acked_seq`` confirms
    offset: int  # a chunk of a split tensor: its byte offset in the tensor
    total: int  # ... and the tensor's total bytes


# op -> (required fields, optional fields); "channel" is implied for every op but shutdown
MESSAGES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "open": (("dir", "role", "rank", "pid", "session", "host", "device", "config"), ()),
    "name": (("id", "name"), ()),
    "begin": (("pass", "meta"), ()),
    "end": (("pass", "meta", "dropped", "skipped"), ("incomplete", "mixed")),
    "note": (("status",), ("error", "budget_reached", "cuda_staging", "dropped", "dropped_passes")),
    "close": (("stats",), ()),
    "shutdown": ((), ()),
}


def open_channel(channel: int, *, dir: str, role: str, rank: dict, pid: int, session: str, host: str,  # noqa: A002
                 device: dict, config: dict) -> dict:
    """A role/rank directory (one session) begins; the writer makes its ChannelWriter from it."""
    return {"op": "open", "channel": channel, "dir": dir, "role": role, "rank": rank, "pid": pid,
            "session": session, "host": host, "device": device, "config": config}


def name(channel: int, name_id: int, name: str) -> dict:
    """The tensor name behind ``name_id`` on this channel (sent once, before its first tensor)."""
    return {"op": "name", "channel": channel, "id": name_id, "name": name}


def begin(channel: int, pass_id: int, meta: dict | None = None) -> dict:
    return {"op": "begin", "channel": channel, "pass": pass_id, "meta": meta or {}}


def end(channel: int, pass_id: int, meta: dict, dropped: int, skipped: dict,
        incomplete: str | None = None, mixed: bool = False) -> dict:
    """A pass ends. ``skipped``: name -> reason. ``incomplete``: why the pass is not whole (stored
    complete = 0); ``mixed``: forwards of several threads ran in it (``verify`` fails on it)."""
    msg = {"op": "end", "channel": channel, "pass": pass_id, "meta": meta, "dropped": dropped,
           "skipped": [{"name": n, "reason": r} for n, r in skipped.items()]}
    if incomplete is not None:
        msg["incomplete"] = incomplete
        if mixed:
            msg["mixed"] = True
    return msg


def note(channel: int, status: str, **facts) -> dict:
    """A status update for rank.json (the writer alone writes it): ``status`` plus any of
    ``error``, ``budget_reached``, ``cuda_staging``, ``dropped``, ``dropped_passes``."""
    unknown = set(facts) - set(MESSAGES["note"][1])
    if unknown:
        raise TypeError(f"note: unknown field(s) {', '.join(sorted(unknown))}")
    return {"op": "note", "channel": channel, "status": status, **facts}


def close(channel: int, stats: dict) -> dict:
    """Flush and finish the channel; ``stats``: the Dumper's ``stats()`` (its counts reach rank.json)."""
    return {"op": "close", "channel": channel, "stats": stats}


def shutdown() -> dict:
    """The writer exits after this one."""
    return {"op": "shutdown"}


def encode(msg: dict) -> bytes:
    return json.dumps(msg).encode()


def decode(payload) -> dict:
    return json.loads(payload)
