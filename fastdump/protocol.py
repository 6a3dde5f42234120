"""The wire protocol between the serving process and the writer, shared by both sides.

Two kinds of ring record (see docs/INTERNALS.md, "Ring protocol"): tensor records and control
records. A control record's payload is one JSON object built by a constructor below, so every
message the writer can receive is defined here, with its fields; INTERNALS' control-message table
is checked against ``MESSAGES`` (tests/test_protocol.py). ``Record`` names the fields of one item of
``_C.Consumer.next_batch``.

CUDA-graph replays (fastdump/staging/graphs.py) travel differently: when a graph is captured, a
``graph`` message gives the writer its layout (tensors, offsets, the replay passes' meta); each
replay is then ONE tensor record, the *replay span* (dtype ``REPLAY_SPAN_DTYPE``, name id
``GRAPH_SPAN_NAME_BASE`` + ..., pass id ``GRAPH_PASS_BASE`` + log position), opening with a
``ReplayHeader`` the GPU wrote. The writer makes the pass from it with ``replay_pass`` (the same
``begin``/``end`` constructors as any pass). The drain thread (C++, no GIL) writes only span
records and the ``graph_drops`` note, from the template ``drop_note_template`` builds here.

Base layer: no torch, no h5py; imported by the staging engine, the Dumper and the writer process.
"""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

from . import format as fmt


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
    "end": (("pass", "meta", "dropped", "skipped"), ("sent", "incomplete", "mixed", "late", "structure")),
    "note": (("status",), ("error", "budget_reached", "cuda_staging", "dropped", "dropped_passes")),
    "close": (("stats",), ()),
    "graph": (("device", "graph", "span_name_id", "span_bytes", "tensors", "meta", "skipped"),
              ("incomplete", "structure")),
    "graph_drops": (("device", "dropped_passes"), ()),
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


def end(channel: int, pass_id: int, meta: dict, dropped: int, skipped: dict, sent: int | None = None,
        incomplete: str | None = None, mixed: bool = False, late: bool = False, structure: dict | None = None) -> dict:
    """A pass ends. ``skipped``: name -> reason. ``sent``: the tensors the producer put into the ring
    for this pass, whole (staged; not its drops nor skips): the writer stores it with the pass and
    ``verify`` fails a pass that holds other than that many. ``incomplete``: why the pass is not whole (stored
    complete = 0); ``mixed``: forwards of several threads ran in it (``verify`` fails on it).
    ``late``: sent again after a full ring refused it (later passes' records came first); the
    writer takes it only for a pass it can still complete without reordering its segments.
    ``structure``: call name -> the container structure of its output, for outputs whose stored
    names do not tell it (docs/FORMAT.md, pass_meta)."""
    msg = {"op": "end", "channel": channel, "pass": pass_id, "meta": meta, "dropped": dropped,
           "skipped": [{"name": n, "reason": r} for n, r in skipped.items()]}
    if sent is not None:
        msg["sent"] = sent
    if incomplete is not None:
        msg["incomplete"] = incomplete
        if mixed:
            msg["mixed"] = True
    if late:
        msg["late"] = True
    if structure:
        msg[fmt.PASS_STRUCTURE] = structure
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


# -- CUDA-graph replays ---------------------------------------------------------------------------
# The values of csrc/cuda_graph_record.h (the GPU writes the header; tests/test_protocol.py checks
# them against the extension's exports).
GRAPH_PASS_BASE = 1 << 40       # replay pass ids: GRAPH_PASS_BASE + log position (replay order)
REPLAY_SPAN_DTYPE = 0xFFFF      # the span record's dtype code (no fastdump.dtypes code)
GRAPH_SPAN_NAME_BASE = 0xF0000000  # span name ids: base + device * GRAPHS_PER_RECORDER + graph
GRAPHS_PER_RECORDER = 4096         # (real name ids stay below the base)
REPLAY_HEADER_BYTES = 256       # the header's room at the start of every span
REPLAY_MAGIC = int.from_bytes(b"FDREPLAY", "little")


class ReplayHeader(NamedTuple):
    """The first bytes of a replay span, written by the replay itself on the GPU."""
    magic: int
    pass_id: int
    replay: int  # the graph's replay index (dropped replays included: gaps are drops)
    span_name_id: int
    span_bytes: int
    graph: int  # the graph's number (the ``graph`` message's): ids are reused, numbers never


_REPLAY_HEADER = struct.Struct("<6Q")


def replay_header(payload) -> ReplayHeader:
    return ReplayHeader._make(_REPLAY_HEADER.unpack_from(payload, 0))


def graph(channel: int, device: int, graph_id: int, span_name_id: int, span_bytes: int, tensors: list,
          meta: dict, skipped: dict, incomplete: str | None = None, structure: dict | None = None) -> dict:
    """A graph was captured: its replays arrive as span records of ``span_name_id`` and
    ``span_bytes``; ``tensors``: ``[name_id, dtype, shape, offset, nbytes]`` each, offsets from the
    span's start. ``meta``: every replay pass's meta (``cuda_graph``, ``graph_batch``, the capture
    pass's own); ``skipped``: name -> why the replays lack it; ``incomplete``: why every replay
    pass is not a whole forward (the capture's pass was not: e.g. its forward raised);
    ``structure``: the capture pass's output structures (``end``'s), which every replay pass carries."""
    msg = {"op": "graph", "channel": channel, "device": device, "graph": graph_id, "span_name_id": span_name_id,
           "span_bytes": span_bytes, "tensors": [[int(n), int(d), [int(x) for x in shape], int(o), int(b)]
                                                 for n, d, shape, o, b in tensors],
           "meta": meta, "skipped": [{"name": n, "reason": r} for n, r in skipped.items()]}
    if incomplete is not None:
        msg["incomplete"] = incomplete
    if structure:
        msg[fmt.PASS_STRUCTURE] = structure
    return msg


def graph_drops(channel: int, device: int, dropped_passes: int) -> dict:
    """The replays one GPU's recorder of this channel dropped so far (absolute, monotonic)."""
    return {"op": "graph_drops", "channel": channel, "device": device, "dropped_passes": dropped_passes}


_DROP_MARK = 987654321987654321  # stands for the count in the drain's template (found exactly once)


def drop_note_template(channel: int, device: int) -> tuple[str, str]:
    """(JSON, mark): the ``graph_drops`` message with ``mark`` where the C++ drain puts its count."""
    text = encode(graph_drops(channel, device, _DROP_MARK)).decode()
    mark = str(_DROP_MARK)
    assert text.count(mark) == 1
    return text, mark


_PASS_MARK = 876543210876543210  # stands for the pass id in plain_pass_templates (found exactly once)
_SENT_MARK = 765432109876543210  # stands for the sent count in plain_pass_templates (found exactly once)


def plain_pass_templates(channel: int) -> tuple[str, str, str, str, str]:
    """(begin, end, pass mark, dropped mark, sent mark): a pass's plain begin and end (no meta,
    nothing skipped) as encode() gives them, with marks where the channel's C++ lane puts the pass
    id, the dropped count and the sent count (ChannelStager.set_pass_templates; open_pass and
    put_plain_end send them)."""
    return (encode(begin(channel, _PASS_MARK)).decode(),
            encode(end(channel, _PASS_MARK, {}, _DROP_MARK, {}, sent=_SENT_MARK)).decode(),
            str(_PASS_MARK), str(_DROP_MARK), str(_SENT_MARK))


def replay_pass(channel: int, layout: dict, header: ReplayHeader) -> tuple[dict, dict]:
    """The ``begin`` and ``end`` of the pass a replay span makes (``layout``: its ``graph`` message).
    The meta says which replay of which graph: ``graph_replay`` is the header's replay index. Its
    ``sent``: the graph's tensors, every one of them in each replay's span (the graph's slots are
    fixed when it is captured)."""
    meta = dict(layout["meta"], graph_replay=header.replay)
    skipped = {e["name"]: e["reason"] for e in layout["skipped"]}
    return begin(channel, header.pass_id, meta), end(channel, header.pass_id, meta, 0, skipped,
                                                     sent=len(layout["tensors"]),
                                                     incomplete=layout.get("incomplete"),
                                                     structure=layout.get(fmt.PASS_STRUCTURE))


# Every pass sends a begin and an end, most of them with no meta and nothing skipped: those two are
# formatted directly (a fifteenth of json.dumps' time, ~9 us of a pass's ~32 us on a slow CPU), the
# same bytes json.dumps gives them (tests/test_protocol.py); anything else goes through json.
_PLAIN_BEGIN = b'{"op": "begin", "channel": %d, "pass": %d, "meta": {}}'
_PLAIN_END = b'{"op": "end", "channel": %d, "pass": %d, "meta": {}, "dropped": %d, "skipped": [], "sent": %d}'


def fit(msg: dict, payload: bytes, max_bytes: int) -> bytes | None:
    """``msg``'s payload cut to ``max_bytes`` (a record takes at most half the ring), or None when
    it cannot be. An end keeps what a pass needs (its drop count, completeness) and says what it
    lost: a user's metadata of any size, or a huge skip list, must not lose the end itself (the
    pass would be stored incomplete, its drops counted in no pass) nor make the sender spin."""
    if len(payload) <= max_bytes:
        return payload
    if msg.get("op") != "end":
        return None
    cut = dict(msg, meta={"fastdump_meta_error": f"the end message carrying it took {len(payload)} bytes, "
                                                 f"more than the ring's record limit ({max_bytes})"})
    if fmt.PASS_STRUCTURE in cut:  # (export then says the pass's output structures were not recorded)
        cut[fmt.PASS_STRUCTURE] = {fmt.STRUCTURE_LOST: "the end message exceeded the ring's record limit"}
    payload = encode(cut)
    if len(payload) > max_bytes:
        skipped = msg.get("skipped") or []
        cut["skipped"] = [{"name": "(fastdump)", "reason": f"{len(skipped)} skipped tensors not listed: "
                                                          "their list exceeded the ring's record limit"}]
        payload = encode(cut)
    return payload if len(payload) <= max_bytes else None


def encode(msg: dict) -> bytes:
    op = msg.get("op")
    if op == "begin" and len(msg) == 4 and msg["meta"] == {}:
        channel, pass_id = msg["channel"], msg["pass"]
        if type(channel) is int and type(pass_id) is int:  # (not bool, not a float: %d would hide it)
            return _PLAIN_BEGIN % (channel, pass_id)
    elif op == "end" and len(msg) == 7 and msg["meta"] == {} and msg["skipped"] == [] and "sent" in msg:
        channel, pass_id, dropped, sent = msg["channel"], msg["pass"], msg["dropped"], msg["sent"]
        if type(channel) is int and type(pass_id) is int and type(dropped) is int and type(sent) is int:
            return _PLAIN_END % (channel, pass_id, dropped, sent)
    return json.dumps(msg).encode()


def decode(payload) -> dict:
    return json.loads(payload)
