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

struct GraphRecorderStats {
  uint64_t graphs = 0;             // captures that recorded a commit (graphs whose replays are passes)
  uint64_t captured_tensors = 0;   // tensors recorded into those graphs
  uint64_t replays = 0;            // replays turned into passes (handed to the writer)
  uint64_t dropped_replays = 0;    // replays the device found no room for (counted inside the graph),
                                   // and drained replays whose pass could not be begun (writer behind)
  uint64_t lost_pass_ends = 0;     // replay passes whose end record could not be written
  uint64_t tensors = 0;            // tensors of those passes staged
  uint64_t bytes = 0;
  uint64_t dropped_tensors = 0;    // tensors of replay passes the stager dropped or could not stage
  uint64_t slot_bytes = 0;         // static per-tensor slots (all graphs)
  uint64_t slot_used = 0;
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
  GraphRecorder(CudaStager* stager, uint32_t channel, int device, uint64_t slot_bytes, uint64_t ring_bytes,
                uint32_t log_entries = 1024);
  ~GraphRecorder();
  GraphRecorder(const GraphRecorder&) = delete;
  GraphRecorder& operator=(const GraphRecorder&) = delete;

  // A captured pass starts on `stream` (which must be capturing). Returns the graph's id. Throws
  // std::runtime_error when another capture of this recorder is open, or the recorder is closed.
  int begin_graph(uintptr_t stream);
  // Snapshot `src` into a static slot, on the capturing stream (recorded into the graph). Returns
  // kStaged, kTooLarge (more than kMaxDims dimensions) or kNoSpace (the slots or the replay ring
  // cannot hold it: the graph's replays will lack it). Throws on CUDA errors.
  int record(uint32_t name_id, uint16_t dtype, const CudaSource& src);
  // The captured pass ends: record the commit kernels (claim, copy, publish) on the capturing
  // stream. meta_json: the replay passes' meta (a JSON object); skipped_json: a JSON list of
  // {name, reason}. Returns the graph id, or -1 when nothing was recorded (no commit).
  int end_graph(const std::string& meta_json, const std::string& skipped_json);
  // Forget the open capture without a commit (its slots stay reserved: the graph may still exist).
  void abort_graph();
  bool capturing() const;

  // Tests and benchmarks: a paused drain lets replays pile up (and be dropped) on the device.
  void set_paused(bool paused);
  // Wait until every replay published so far is a pass whose tensors reached the host ring.
  bool flush(double timeout_s);
  GraphRecorderStats stats();
  // Stop the drain thread (after flushing). Replays after close are neither recorded nor counted.
  // Device memory is kept unless free_memory or no graph was committed: graphs captured with this
  // recorder write into it on every replay, so it may be freed only once they are destroyed.
  // Callable again later with free_memory = true.
  void close(double timeout_s, bool free_memory);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fastdump
