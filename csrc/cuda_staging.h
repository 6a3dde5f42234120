// CUDA staging: device snapshot ring, side-stream D2H drain into the shared-memory host ring.
// Design and reasoning: docs/CUDA.md. Compiled only when a CUDA toolkit is found (setup.py);
// this header is plain C++ (no CUDA or Python headers) so module/bindings code can include it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ring.h"

namespace fastdump {


// Called by stage() right before it may wait (ring full, `block` policy). The Python binding
// releases the GIL there, so the fast path keeps it and only waits give it up. Called at most
// once per stage() call that waits; the binding re-acquires when stage() returns.
class BlockHook {
 public:
  virtual ~BlockHook() = default;
  virtual void before_block() = 0;
};

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  std::string uuid;        // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it
  std::string pci_bus_id;  // "0000:3b:00.0"
  uint64_t total_memory = 0;
  int major = 0;
  int minor = 0;
  int multiprocessors = 0;
};

struct CudaInfo {
  std::string built_with;   // toolkit version the extension was compiled with, "13.0"
  int runtime_version = 0;  // cudaRuntimeGetVersion (the statically linked runtime)
  int driver_version = 0;   // cudaDriverGetVersion: 0 when no driver is installed
  int device_count = 0;
  std::vector<CudaDeviceInfo> devices;
  std::string reason;       // why no GPU is usable (empty when device_count > 0)
};

// Never throws; does not create a CUDA context.
CudaInfo cuda_query_info();

// Device ordinal owning a device pointer; -1 for host or unknown memory. Throws on CUDA errors.
int cuda_pointer_device(uintptr_t ptr);

// A device tensor: raw pointer (first element), shape and strides in elements, the stream that
// produced it (cudaStream_t as an integer; 0 = legacy default stream).
struct CudaSource {
  uintptr_t ptr = 0;
  uint64_t elem_size = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  int device = 0;
  uintptr_t stream = 0;
  // The stream that produced the tensor when it is not `stream` (0: the same). The snapshot on
  // `stream` then waits for the work issued so far on it.
  uintptr_t producer_stream = 0;
};

struct CudaDeviceStats {
  int device = 0;
  uint64_t ring_bytes = 0;
  uint64_t ring_used = 0;
  uint64_t in_flight_batches = 0;
};

struct CudaStagerStats {
  uint64_t tensors = 0;             // stage() calls that staged a tensor
  uint64_t records = 0;             // host records filled by the CUDA path
  uint64_t snapshots = 0;           // device-to-device snapshot operations (memcpy, 2D or kernel)
  uint64_t snapshot_kernels = 0;    // ... of which strided-gather kernel launches
  uint64_t snapshot_2d = 0;         // ... of which cudaMemcpy2DAsync
  uint64_t snapshot_bytes = 0;
  uint64_t d2h_copies = 0;          // device-to-host copies (entries of batches)
  uint64_t d2h_batches = 0;         // batches (one cudaMemcpyBatchAsync, or a loop of memcpys)
  uint64_t d2h_bytes = 0;
  uint64_t published = 0;           // records handed to the writer
  uint64_t cancelled = 0;           // reserved records turned into padding (failure paths)
  uint64_t dropped = 0;             // tensors dropped by this stager (ring full under `drop`)
  uint64_t capturing_skipped = 0;   // stage() calls refused because the stream was capturing
  uint64_t lean_tensors = 0;        // ... of `tensors`, staged by the lean path (stage_lean)
  uint64_t lean_checks = 0;         // device/capture checks the lean path made (per pass and stream)
  uint64_t snapshot_events = 0;     // events recorded after snapshots (one per N lean snapshots)
  uint64_t drain_wakeups = 0;       // batches handed to the drain with a wake-up (lean seals)
  uint64_t timer_seals = 0;         // lean batches the drain sealed itself (older than the hold time)
  uint32_t events_every = 0;        // N: lean snapshots per event
  uint64_t device_ring_full_waits = 0;
  double device_ring_wait_seconds = 0;
  uint64_t host_ring_full_waits = 0;
  double drain_seconds = 0;         // wall time with at least one D2H batch in flight
  double register_seconds = 0;      // cudaHostRegister of the host ring
  uint64_t registered_bytes = 0;
  bool batch_api = false;           // cudaMemcpyBatchAsync in use (else per-copy cudaMemcpyAsync)
  std::string batch_api_fallback;   // why the drain gave cudaMemcpyBatchAsync up for per-copy copies
                                    // ("" unless the runtime refused it: staging goes on, no error)
  std::string last_error;
  bool broken = false;              // staging stopped for good (last_error says why)
  long drain_timer_slack_ns = -1;   // the drain thread's timer slack (-1: not started yet)
  std::vector<CudaDeviceStats> devices;
};

// Enqueue a snapshot of the whole of `src` (C order) into the contiguous device buffer `dst`, on
// src.stream: cudaMemcpyAsync or the strided-gather kernel, as stage() does. Capturable. Throws.
void snapshot_whole(uint8_t* dst, const CudaSource& src, int sm_count);
// Make `prev` the thread's device again, but only if its primary context exists (no stray context).
void cuda_restore_device(int prev);

// One producer thread's lean staging state (docs/CUDA.md, "The eager path"): the device and
// capture checks it made for the current pass and stream, and the snapshots enqueued since its
// last event. Made by CudaStager::open_lane, owned by the stager (valid until it is destroyed).
class CudaLane;

// One per process (shared by every role/channel): per device a device ring, a side stream and an
// event pool; one drain thread for all devices. Thread-safe: several threads may stage at once.
class CudaStager {
 public:
  // `producer` must outlive the stager (the binding keeps it alive).
  CudaStager(Producer* producer, uint64_t device_ring_bytes);
  ~CudaStager();
  CudaStager(const CudaStager&) = delete;
  CudaStager& operator=(const CudaStager&) = delete;

  // Returns a StageStatus (kStaged, kDropped, kDisabled, kTooLarge) or kCapturing. A ring full
  // under `block == false` drops the tensor and counts it (also in the producer's dropped count).
  // Never synchronizes the device or the producer stream. Throws std::runtime_error on CUDA errors.
  int stage(uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype, const CudaSource& src,
            bool block, BlockHook* hook, double timeout_s = kWaitForever);

  // The lean path of stage() (the extension's per-tensor hot path): for the pass `pass_id`, the
  // current device and the capture state of src.stream are checked once (again when the device or
  // the stream changes); the snapshot goes on src.stream and the lane's batch, and one event is
  // recorded per `events_every` snapshots (and at end_pass), after which the drain gets the whole
  // batch with one wake-up. It never waits: a tensor that needs a wait, several host records, a
  // device guard or a producer stream goes through stage() (the lane's batch sealed first).
  // Returns what stage() returns (kCapturing uncounted: the caller stages it through stage(), which
  // counts it). Thread-safe per lane (a short lock, never held while waiting).
  int stage_lean(CudaLane* lane, uint32_t channel, uint32_t name_id, int64_t pass_id, uint16_t dtype,
                 const CudaSource& src, bool block, BlockHook* hook, double timeout_s = kWaitForever);
  // Record the event of the lane's open batch and hand it to the drain (the pass ended).
  void end_pass(CudaLane* lane);
  // A CUDA graph capture is about to begin somewhere in this process (fastdump/staging/cuda.py calls
  // it from torch's CUDAGraph.capture_begin): every lane checks its stream again at its next tensor,
  // so a capture begun mid-pass on a stream a pass already checked is seen (one load per tensor).
  static void note_capture_begin();
  // Held (enter = true) by the thread that begins a CUDA graph capture through torch, around
  // torch's cudaStreamBeginCapture, and released (false) right after. Seals made from another
  // thread than the lane's (the drain's hold timer, flush, a thread about to wait for space) hold
  // it across their capture check and their cudaEventRecord: otherwise a capture begun between the
  // two got our event as a node of the user's graph. Re-entrant per thread (no-op when held).
  static void capture_gate(bool enter);
  CudaLane* open_lane();
  // Lean snapshots per event (N >= 1; FASTDUMP_CUDA_EVENTS_EVERY sets the default, 64).
  void set_events_every(uint32_t n);
  uint32_t events_every() const;

  // Pin the host ring's data area (cudaHostRegister, portable, in 256 MiB pieces). Idempotent.
  // Runs on `device` (-1: the lowest device with a context already, else the current one), so it
  // never creates a context on a GPU the process does not use. Returns the seconds it took (0 when
  // already done). Throws when CUDA is unusable.
  double register_host(int device = -1);

  // Allocate the device ring, side stream and events of `device` now rather than at its first
  // tensor. Throws std::runtime_error when the ring cannot be allocated (remembered: stage() on
  // that device then throws the same error).
  void prepare(int device);

  // Records of `device` handed to the drain so far / finished (published or cancelled). They finish
  // in order: once completed(d) reaches a value submitted(d) returned, those records (and their
  // snapshots) no longer read their sources, which may then be freed. After close(): UINT64_MAX.
  uint64_t submitted(int device) const;
  uint64_t completed(int device) const;

  // Wait until every record staged so far is published to the host ring. False on timeout.
  bool flush(double timeout_s);

  CudaStagerStats stats();

  // Flush, stop the drain thread, unpin, free device memory. Later stage() calls return kDisabled.
  void close(double timeout_s = 60.0);

  uint64_t device_ring_bytes() const;
  Producer* producer() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fastdump
