"""fastdump.protocol: every control message is built in one place, the writer reads what the
constructors build, and docs/INTERNALS.md's control-message table says the same."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fastdump import _C, protocol

INTERNALS = Path(__file__).resolve().parent.parent / "docs" / "INTERNALS.md"


def _doc_table() -> dict:
    text = INTERNALS.read_text()
    section = text[text.index("## Control messages"):]
    section = section[:section.index("\n## ", 3)] if "\n## " in section[3:] else section
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[0]):
            fields = re.sub(r"\([^)]*\)", "", cells[1])  # parentheses describe a field, they are not fields
            rows[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", fields))
    return rows


def test_internals_table_lists_every_message_with_its_fields():
    table = _doc_table()
    assert set(table) == set(protocol.MESSAGES)
    for op, (required, optional) in protocol.MESSAGES.items():
        fields = set(required) | set(optional) | ({"channel"} if op != "shutdown" else set())
        assert table[op] == fields, f"{op}: INTERNALS says {sorted(table[op])}, protocol has {sorted(fields)}"


def test_an_end_cut_to_fit_says_its_structure_record_was_lost():
    """The output-structure record goes with the metadata when an end is too large for a record; it
    is replaced by a marker (export then warns that names alone decide), never kept half."""
    structure = {f"layer{i}.experts": {"kinds": {"": "tuple:empty"}, "after": i} for i in range(3000)}
    msg = protocol.end(3, 7, {}, 0, {}, structure=structure)
    full = protocol.encode(msg)
    assert json.loads(full)["structure"] == structure
    cut = json.loads(protocol.fit(msg, full, 4096))
    assert cut["structure"] == {"(fastdump)": "the end message exceeded the ring's record limit"}
    assert (cut["pass"], cut["dropped"], cut["skipped"]) == (7, 0, [])
    assert "structure" not in protocol.end(3, 7, {}, 0, {}, structure={})  # nothing to record: a plain end


def test_constructors_build_exactly_the_declared_fields():
    built = {
        "open": protocol.open_channel(3, dir="/d", role="target", rank={"tp_rank": 0}, pid=1, session="s",
                                      host="h", device={}, config={}),
        "name": protocol.name(3, 7, "model.layers.0"),
        "begin": protocol.begin(3, 5),
        "end": protocol.end(3, 5, {"k": 1}, 2, {"x": "why"}, incomplete="raised", mixed=True),
        "note": protocol.note(3, "running", budget_reached=True),
        "close": protocol.close(3, {"passes": 1}),
        "shutdown": protocol.shutdown(),
        "graph": protocol.graph(3, 0, 1, protocol.GRAPH_SPAN_NAME_BASE + 1, 512, [(7, 4, (2, 3), 256, 24)],
                                {"cuda_graph": 1, "graph_batch": 2}, {"x": "why"}),
        "graph_drops": protocol.graph_drops(3, 0, 5),
    }
    for op, msg in built.items():
        required, optional = protocol.MESSAGES[op]
        keys = set(msg) - {"op", "channel"}
        assert msg["op"] == op and set(required) <= keys <= set(required) | set(optional), op
        assert protocol.decode(protocol.encode(msg)) == msg
    assert built["end"]["skipped"] == [{"name": "x", "reason": "why"}]
    assert built["graph"]["tensors"] == [[7, 4, [2, 3], 256, 24]] and built["graph"]["skipped"] == built["end"]["skipped"]
    assert "incomplete" not in protocol.end(3, 5, {}, 0, {}, mixed=True)  # mixed only with incomplete
    with pytest.raises(TypeError, match="budget"):
        protocol.note(3, "running", budget=True)


def test_plain_begin_and_end_encode_to_the_bytes_json_gives():
    """encode() formats a pass's plain begin/end itself: the same bytes as json.dumps, and
    everything else (meta, skips, odd numbers) still through json."""
    plain = [protocol.begin(0, 1), protocol.begin(7, 2**40 + 3), protocol.end(3, 5, {}, 0, {}, sent=0),
             protocol.end(65535, 2**63 - 1, {}, 12, {}, sent=2**64 - 1), protocol.end(1, -1, {}, 0, {}, sent=7)]
    other = [protocol.begin(3, 5, {"step": 1}), protocol.end(3, 5, {}, 0, {"x": "why"}, sent=1),
             protocol.end(3, 5, {}, 0, {}, sent=1, incomplete="raised"), protocol.begin(True, 5),
             protocol.begin(3, 5.0), protocol.end(3, 5, {}, False, {}, sent=1), protocol.end(3, 5, {}, 0, {}),
             protocol.end(3, 5, {}, 0, {}, sent=True), protocol.end(3, 5, {}, 0, {}, sent=1.0),
             {"op": "begin", "channel": 1, "pass": 2, "meta": {}, "extra": 1},
             {"op": "end", "channel": 1, "pass": 2, "meta": {}, "dropped": 0, "skipped": [], "extra": 1}]
    for msg in plain + other:
        assert protocol.encode(msg) == json.dumps(msg).encode(), msg
        assert protocol.decode(protocol.encode(msg)) == msg


def test_next_batch_items_are_records_in_the_declared_order():
    name = f"/fastdump-test-protocol-{np.random.randint(1 << 30)}"
    producer = _C.Producer(name, 1 << 20, 0)
    try:
        consumer = _C.Consumer(name)
        data = np.arange(6, dtype=np.float32).reshape(2, 3)
        assert producer.stage_host(2, 9, 4, 0, 4, (2, 3), (3, 1), data.ctypes.data, True) == _C.STAGED
        seq = producer.put_control(2, protocol.encode(protocol.begin(2, 4)))
        batch = consumer.next_batch(1.0)
    finally:
        producer.unlink()
    tensor, control = (protocol.Record._make(item) for item in batch[:2])
    assert len(batch[0]) == len(protocol.Record._fields)
    assert (tensor.kind, tensor.channel, tensor.name_id, tensor.pass_id, tensor.shape) == (_C.KIND_TENSOR, 2, 9, 4, (2, 3))
    assert np.array_equal(np.frombuffer(bytes(tensor.payload), np.float32), data.ravel())
    assert (tensor.offset, tensor.total) == (0, data.nbytes)
    assert control.kind == _C.KIND_CONTROL and control.seq == seq
    assert protocol.decode(control.payload) == protocol.begin(2, 4)


def test_replay_pass_is_built_with_the_begin_and_end_constructors():
    """The writer makes a CUDA-graph replay's pass from its ``graph`` message and the span header:
    the same messages protocol.begin/end build, the meta naming the replay."""
    layout = protocol.graph(2, 0, 1, protocol.GRAPH_SPAN_NAME_BASE + 1, 512, [], {"cuda_graph": 1, "graph_batch": 8},
                            {"x": "why"})
    header = protocol.ReplayHeader(protocol.REPLAY_MAGIC, protocol.GRAPH_PASS_BASE + 9, 4, layout["span_name_id"], 512, 1)
    begin, end = protocol.replay_pass(2, layout, header)
    meta = {"cuda_graph": 1, "graph_batch": 8, "graph_replay": 4}
    assert begin == protocol.begin(2, protocol.GRAPH_PASS_BASE + 9, meta)
    assert end == protocol.end(2, protocol.GRAPH_PASS_BASE + 9, meta, 0, {"x": "why"}, sent=0)
    # its count: every tensor of the graph (its slots are fixed at capture), whatever the replay
    two = dict(layout, tensors=[[5, 7, [2], 256, 8], [6, 7, [2, 2], 264, 16]])
    assert protocol.replay_pass(2, two, header)[1]["sent"] == 2
    assert layout["meta"] == {"cuda_graph": 1, "graph_batch": 8}  # the layout is not changed


def test_the_lanes_plain_begin_and_end_records_are_the_bytes_encode_gives():
    """ChannelStager.open_pass / put_plain_end (a pass's begin and end in one C call each), from
    protocol.plain_pass_templates, put the same bytes protocol.encode gives the plain messages, edge
    values included; templates without each mark once are refused; a full ring puts nothing and
    leaves the lane's pass settings alone (the caller's general path decides)."""
    torch = pytest.importorskip("torch")
    name = f"/fastdump-test-protocol-{np.random.randint(1 << 30)}"
    producer = _C.Producer(name, 1 << 20, 0)
    try:
        consumer = _C.Consumer(name)
        cases = [(0, 1, 0, 3), (65535, 2**63 - 1, 12, 0), (7, 2**40 + 3, 2**64 - 1, 2**64 - 1), (3, -1, 0, 1)]
        expected = []
        for channel, pass_id, dropped, sent in cases:
            lane = _C.ChannelStager(producer, channel)
            assert lane.open_pass(pass_id, True, 1.0) == 0  # no templates yet: the Python path sends it
            lane.set_pass_templates(*protocol.plain_pass_templates(channel))
            begin_seq = lane.open_pass(pass_id, True, 1.0)
            end_seq = lane.put_plain_end(pass_id, dropped, sent)
            assert 0 < begin_seq < end_seq
            expected += [(begin_seq, channel, protocol.encode(protocol.begin(channel, pass_id))),
                         (end_seq, channel,
                          protocol.encode(protocol.end(channel, pass_id, {}, dropped, {}, sent=sent)))]
        got = [protocol.Record._make(item) for item in consumer.next_batch(1.0)]
        assert [(r.seq, r.channel, bytes(r.payload)) for r in got] == expected
        assert all(r.kind == _C.KIND_CONTROL for r in got)
        consumer.release()
    finally:
        producer.unlink()
    with pytest.raises(ValueError, match="exactly once"):
        lane.set_pass_templates('{"pass": 1, "again": 1}', '{"pass": 1, "dropped": 2, "sent": 3}', "1", "2", "3")
    with pytest.raises(ValueError, match="exactly once"):
        lane.set_pass_templates('{"pass": 1}', '{"dropped": 2, "pass": 1, "sent": 3}', "1", "2", "3")  # the count first
    with pytest.raises(ValueError, match="exactly once"):
        lane.set_pass_templates('{"pass": 1}', '{"pass": 1, "sent": 3, "dropped": 2}', "1", "2", "3")  # sent first
    # A ring with no room: nothing is put, and the pass settings stay as they were.
    name = f"/fastdump-test-protocol-{np.random.randint(1 << 30)}"
    producer = _C.Producer(name, 64 * 1024, 0)
    try:
        lane = _C.ChannelStager(producer, 1, {torch.float32: (7, 4)}, torch.strided)
        lane.set_pass_templates(*protocol.plain_pass_templates(1))
        lane.begin(5, False, 0.0)
        for size in (1000, 1):  # full to the last record's worth
            while producer.put_control(1, b"x" * size, False):
                pass
        assert lane.open_pass(6, True, 1.0) == 0 and lane.put_plain_end(6, 0, 0) == 0
        # still pass 5 under `drop`: a tensor that does not fit is dropped, not waited for
        assert lane.stage_tensor(1, torch.ones(4096)) == _C.DROPPED
    finally:
        producer.unlink()


def test_an_end_too_large_for_a_record_is_cut_to_fit_and_says_what_it_lost():
    skipped = {f"layer{i}.q": "quantized tensor " + "r" * 50 for i in range(2000)}
    msg = protocol.end(3, 7, {"big": "x" * 100_000}, 5, skipped, incomplete="forward raised")
    full = protocol.encode(msg)
    assert protocol.fit(msg, full, len(full)) is full  # fits: unchanged
    cut = json.loads(protocol.fit(msg, full, len(full) - 50_000))  # the metadata goes, the skips stay
    assert cut["meta"]["fastdump_meta_error"].startswith(f"the end message carrying it took {len(full)} bytes")
    assert (cut["pass"], cut["dropped"], cut["incomplete"], len(cut["skipped"])) == (7, 5, "forward raised", 2000)
    cut = json.loads(protocol.fit(msg, full, 4096))  # the skip list goes too, counted
    assert (cut["pass"], cut["dropped"], cut["incomplete"]) == (7, 5, "forward raised")
    assert cut["skipped"] == [{"name": "(fastdump)", "reason": "2000 skipped tensors not listed: their list "
                                                              "exceeded the ring's record limit"}]
    assert protocol.fit(msg, full, 100) is None  # nothing left to cut
    note = protocol.note(3, "running", error="e" * 1000)
    assert protocol.fit(note, protocol.encode(note), 500) is None  # only an end is cut
