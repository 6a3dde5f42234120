// CUDA-graph record mode: module outputs snapshotted INSIDE a captured CUDA graph, so that every
// replay of the graph becomes one pass. Design and limits: docs/CUDA.md, "CUDA graphs".
// Plain C++ header (no CUDA or Python headers), like cuda_staging.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda_staging.h"

namespace fastdump {

// Replay passes are numbered from here, in replay order (eager passes count from 0).
constexpr int64_t kGraphPassBase = int64_t(1) << 40;

// Each replay reaches the writer as ONE tensor record (chunked when large): the graph's whole span,
// dtype kReplaySpanDtype, name id kGraphSpanNameBase + device * kMaxGraphsPerRecorder + graph id
// (ids of graphs whose slots reclaim() gave back are reused; the header names the graph's number),
// the replay pass's id. The writer splits it into the pass's tensors with the layout the "graph"
// control message gave when the graph was captured (fastdump/protocol.py, docs/INTERNALS.md). The
// span opens with a ReplayHeader written on the device by the replay itself.
constexpr uint16_t kReplaySpanDtype = 0xFFFF;          // no fastdump.dtypes code
constexpr uint32_t kGraphSpanNameBase = 0xF0000000u;   // name ids of real tensors stay below
constexpr uint32_t kMaxGraphsPerRecorder = 4096;
constexpr uint64_t kReplayHeaderBytes = 256;           // the header's room at the start of every span
constexpr uint64_t kReplayMagic = 0x59414c5045524446ull;  // the bytes "FDREPLAY"
struct ReplayHeader {       // little-endian, at offset 0 of the span record's payload
  uint64_t magic;           // kReplayMagic
  uint64_t pass_id;         // kGraphPassBase + log position (equals the record's pass id)
  uint64_t replay;          // the graph's replay index (dropped replays included)
  uint64_t span_name_id;    // equals the record's name id
  uint64_t span_bytes;      // equals the record's payload size
  uint64_t graph;           // the graph's number: never reused by the recorder (its id, in the name, is)
};
static_assert(sizeof(ReplayHeader) == 48 && sizeof(ReplayHeader) <= kReplayHeaderBytes, "replay header layout");

struct GraphTensorLayout {  // one recorded tensor inside a graph's span
  uint32_t name_id;
  uint16_t dtype;
  std::vector<int64_t> shape;
  uint64_t offset;          // from the span's start (the header included)
  uint64_t nbytes;
};

struct GraphRecorderStats {
  uint64_t graphs = 0;             // captures that recorded a commit (graphs whose replays are passes)
  uint64_t live_graphs = 0;        // ... of which hold a graph id now (at most kMaxGraphsPerRecorder)
  uint64_t captured_tensors = 0;   // tensors recorded into those graphs
  uint64_t replays = 0;            // replays turned into passes (their span record handed to the writer)
  uint64_t dropped_replays = 0;    // replays the device found no room for (counted inside the graph),
                                   // and drained replays whose span record could not be staged
  uint64_t unwritten_replays = 0;  // ... of which replays published but not written: their record
                                   // could not be staged, or close() ran out of time before it
  uint64_t tensors = 0;            // tensors of those passes
  uint64_t bytes = 0;              // their bytes (headers and alignment not counted)
  uint64_t span_records = 0;       // stage() calls of the drain: one per replay
  uint64_t slot_bytes = 0;         // static per-tensor slots (all graphs)
  uint64_t slot_used = 0;          // bytes of the slots graphs hold
  uint64_t reclaimed_graphs = 0;   // captures whose slots reclaim() gave back
  uint64_t reclaimed_bytes = 0;
  uint64_t claimed_replays = 0;    // replays that took a log position so far (staged, or to be)
  uint64_t ring_bytes = 0;         // the device replay ring
  std::string last_error;
  bool broken = false;
};

// One per Dumper (channel) and GPU. The capturing thread calls begin_graph / record / end_graph
// while a graph is captured; a drain thread of its own turns published replays into passes through
// the CudaStager (which moves them to the host ring). Device memory is allocated in the constructor
// (at attach): nothing is allocated during a capture.
class GraphRecorder {
 public:
  // slot_bytes: room for every captured tensor of every graph (static, one slot per tensor);
  // ring_bytes: the device replay ring; log_entries: replays that may wait for the drain at once.
  // drop_note: a control message (JSON) with `drop_mark` in place of the recorder's count of
  // dropped replays; the drain sends it, non-blocking, whenever that count changed ("" = never).
  GraphRecorder(CudaStager* stager, uint32_t channel, int device, uint64_t slot_bytes, uint64_t ring_bytes,
                uint32_t log_entries = 1024, const std::string& drop_note = "",
                const std::string& drop_mark = "");
  ~GraphRecorder();
  GraphRecorder(const GraphRecorder&) = delete;
  GraphRecorder& operator=(const GraphRecorder&) = delete;

  // A captured pass starts on `stream` (which must be capturing). Returns the graph's id: a free
  // one (never used, or given back by reclaim() once the drain wrote every replay of its last
  // graph). Throws std::runtime_error when another capture of this recorder is open, or the
  // recorder is closed; std::overflow_error when kMaxGraphsPerRecorder graphs hold an id.
  int begin_graph(uintptr_t stream);
  // Snapshot `src` into a static slot, on the capturing stream (recorded into the graph). Returns
  // kStaged, kTooLarge (more than kMaxDims dimensions) or kNoSpace (the slots or the replay ring
  // cannot hold it: the graph's replays will lack it). Throws on CUDA errors.
  int record(uint32_t name_id, uint16_t dtype, const CudaSource& src);
  // The captured pass ends: record the commit kernels (claim, copy, publish) on the capturing
  // stream. Returns the graph id, or -1 when nothing was recorded (no commit). The replay passes'
  // meta and skips are the writer's business (the "graph" control message, sent by the caller).
  int end_graph();
  // Forget the open capture without a commit (its slots stay reserved: the graph may still exist;
  // not when its capture was invalidated, which makes no graph).
  void abort_graph();
  // The open graph's capture is about to end before its pass did (so it will be given up): record a
  // done event into it now, so that reclaim() can give its slots back once it can never run again.
  void capture_ending();
  // The open capture's serial (0: none): the name reclaim() takes for the slots it holds.
  uint64_t open_serial() const;
  // Give back the slots of captures whose graphs can never be launched again (the caller knows:
  // torch reset or collected them). Waits for each graph's latest launch first (its done event: a
  // replay launched before may be in flight; never a device-wide synchronization, which would
  // invalidate another thread's capture); a graph whose event cannot be waited for (or that has
  // none) keeps its slots. Returns the serials given back.
  std::vector<uint64_t> reclaim(const std::vector<uint64_t>& serials);
  // Waits until the latest launch of every committed graph has run its commit kernels (their done
  // events); close() calls it so replays launched before are dumped. False on an error.
  bool wait_launched();
  // The open graph's capture is over (ended, or its stream captures another since): it can no
  // longer be committed, and tensors must not be recorded into it.
  bool capture_ended();
  // The open graph's capture was invalidated and has not ended yet: it will yield no graph, so
  // none of its replays can go unseen (a failed capture, not a lost graph).
  bool capture_invalidated();
  bool capturing() const;
  // A committed graph's span: its record's name id, size and tensors (what the writer needs).
  uint32_t span_name_id(int graph) const;
  uint64_t graph_number(int graph) const;  // unique per recorder (pass meta `cuda_graph`)
  uint64_t span_bytes(int graph) const;
  std::vector<GraphTensorLayout> layout(int graph) const;
  // Replays dropped so far (device claim and drain), cheap: Channel counts drops through it.
  uint64_t dropped_replays();

  // Tests and benchmarks: a paused drain lets replays pile up (and be dropped) on the device.
  void set_paused(bool paused);
  // Wait until every replay published so far is a pass whose tensors reached the host ring.
  bool flush(double timeout_s);
  GraphRecorderStats stats();
  // Stop the drain thread (after flushing), within about `timeout_s` whatever the writer does:
  // replays the drain has not staged by then are counted as unwritten (dropped_replays), never
  // staged. A replay that claimed before close() closed the recorder is staged (or counted); one
  // that claims after it is dropped and counted until close() returns (the count is final then).
  // Device memory is kept unless free_memory or no graph holds its snapshots (none committed, none
  // given up after recording): graphs captured with this
  // recorder write into it on every replay, so it may be freed only once they are destroyed.
  // Callable again later with free_memory = true.
  void close(double timeout_s, bool free_memory);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fastdump
