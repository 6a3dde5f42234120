// Deterministic check, against the mock CUDA runtime, that CudaStager::stage() never holds
// device-ring space while it waits for the host ring (or for the ring's allocation lock).
// tests/test_cuda.py (test_mock_no_device_space_held_while_waiting_for_host_ring) builds and runs it:
//   g++ -std=c++17 -O1 -g -DFASTDUMP_CUDA_MOCK=1 -Itests/cuda_mock -Icsrc
//       -x c++ csrc/cuda_staging.cu -x none csrc/ring.cpp tests/cuda_mock/ring_cycle.cpp -lrt -pthread
//
// The cycle it sets up (the stress driver's rare hang, tests/cuda_mock/stress.cpp):
//   * B stages, under `block`, a tensor larger than the host ring: its records are reserved one by
//     one as the writer frees space. Its device region (one snapshot) spans several records.
//   * When B's next host record does not fit, C reserves all host records of its tensor at once
//     (reserve_all) and then waits for device-ring space.
//   * The writer waits at the head of the line for C's first record (not published: C has no device
//     space yet); B waits for host space, which only the writer frees; device space is freed in
//     allocation order, so if B still held its region, C could never get space: a deadlock (here
//     bounded by B's timeout, reported as kTorn).
// Layout (record = 65664 bytes: a 64 KiB payload, 1-D; host ring 8.5 records; device ring 1 MiB):
//   1. a lean lane stages 4 records, left in its open batch (hold time and N raised): device
//      [0, 256K), host 4 records;
//   2. B (16 records, > host ring) takes device space for its first segment and host records until
//      one does not fit (try_reserve keeps the ring's control reserve free): its first wait, where
//      before_block() runs the rest from B's own thread (BlockHook);
//   3. the hook: the lane's batch was sealed (before_block seals open batches); wait for every copy
//      and for the reader to consume everything; start C (8 records: host reserve_all fills the
//      emptied ring exactly, pad at the wrap included); wait until C waits for the device ring or
//      has staged; return: B now waits for host space behind C's unpublished records.
// Passes when B and C both stage (kStaged) and every byte arrives; with the old segment layout B
// held [256K, 768K) while C needed 512K at offset 768K (768K with the wrap pad, 512K free).
// Then the other way in: a `drop` stage() (D) whose reservation finds the ring's allocation lock
// held by E (a blocking reservation waiting for the paused writer) must not hold device-ring space
// while it waits for the lock (it used to call Producer::reserve with its region allocated).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "check.h"
#include "cuda_runtime.h"
#include "cuda_staging.h"
#include "ring.h"

using namespace fastdump;

namespace {

constexpr uint64_t kChunk = 64 << 10;
constexpr uint64_t kRecord = 65664;  // align64(64 header + 16 chunk info + 8 shape) + 64 KiB payload

// A device tensor of `n` bytes on `stream`, filled (by a "kernel" on the stream) with `seed`'s bytes.
struct DevTensor {
  void* buf = nullptr;
  std::vector<uint8_t> bytes;
  CudaSource src;
  DevTensor(uint64_t n, unsigned seed, cudaStream_t stream) : bytes(n) {
    for (uint64_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(seed * 131 + i * 7 + i / 251);
    CHECK(cudaMalloc(&buf, n) == cudaSuccess, "cudaMalloc");
    uint8_t* dev = static_cast<uint8_t*>(buf);
    const std::vector<uint8_t>* b = &bytes;
    fdmock::enqueue(stream, [dev, b] { std::memcpy(fdmock::dev_bytes(dev), b->data(), b->size()); });
    src.ptr = reinterpret_cast<uintptr_t>(buf);
    src.elem_size = 1;
    src.shape = {static_cast<int64_t>(n)};
    src.strides = {1};
    src.device = 0;
    src.stream = reinterpret_cast<uintptr_t>(stream);
  }
};

template <typename F>
bool wait_until(F cond, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

}  // namespace

int main() {
  setenv("FASTDUMP_CUDA_HOLD_MS", "100000000", 1);  // the lane's batch stays open until sealed
  fdmock::config().device_count = 1;
  fdmock::config().max_delay_us = 0;

  const uint64_t host_cap = 8 * kRecord + 32768;  // 8.5 records (a multiple of 64)
  const std::string name = "/fdcycle-" + std::to_string(getpid());
  Producer prod(name, host_cap, kChunk);
  prod.region().unlink();
  CHECK(prod.region().capacity() == host_cap && prod.chunk_bytes() == kChunk, "ring %llu chunk %llu",
        (unsigned long long)prod.region().capacity(), (unsigned long long)prod.chunk_bytes());
  RingHeader* hdr = prod.region().header();
  uint8_t* data = prod.region().data();

  // The writer: consumes READY records in order, keeps each (channel, name)'s bytes.
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> got;
  auto bytes_of = [&](uint32_t channel, uint32_t name_id) { return got[std::make_pair(channel, name_id)]; };
  std::atomic<bool> stop_reader{false}, paused{false};
  std::thread reader([&] {
    for (;;) {
      if (paused.load()) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      const uint64_t tail = hdr->tail.load(std::memory_order_relaxed);
      if (tail == hdr->head.load(std::memory_order_acquire)) {
        if (stop_reader.load()) break;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      auto* rec = reinterpret_cast<RecordHeader*>(data + tail % host_cap);
      if (rec->state.load(std::memory_order_acquire) != kReady) {
        if (stop_reader.load()) break;  // a record never published: reported by the checks below
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      if (rec->kind == kTensor) {
        ChunkInfo chunk;
        std::memcpy(&chunk, reinterpret_cast<uint8_t*>(rec) + sizeof(RecordHeader), sizeof(ChunkInfo));
        auto& g = got[{rec->channel, rec->name_id}];
        if (g.size() < chunk.total) g.resize(chunk.total);
        const uint8_t* payload = reinterpret_cast<uint8_t*>(rec) + payload_offset(rec->ndim);
        if (chunk.offset + rec->payload_len <= chunk.total)
          std::memcpy(g.data() + chunk.offset, payload, rec->payload_len);
      }
      hdr->tail.store(tail + rec->total_len, std::memory_order_release);
    }
  });

  int status_b = -1, status_c = -1;
  double seconds_b = 0;
  {
    CudaStager stager(&prod, 1 << 20);
    CHECK(stager.device_ring_bytes() == (1u << 20), "device ring %llu", (unsigned long long)stager.device_ring_bytes());
    stager.register_host();
    stager.prepare(0);
    stager.set_events_every(1000);
    cudaStream_t stream = nullptr;
    CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, 0) == cudaSuccess, "stream");

    // 1. Four lean records left in the lane's open batch: device [0, 256K).
    CudaLane* lane = stager.open_lane();
    std::vector<DevTensor*> lean;
    for (uint32_t i = 0; i < 4; ++i) {
      lean.push_back(new DevTensor(kChunk, 10 + i, stream));
      CHECK(stager.stage_lean(lane, 1, i, 1, 0, lean.back()->src, true, nullptr) == kStaged, "lean %u", i);
    }
    CHECK(stager.stats().lean_checks == 1, "the lean path did not take them");

    DevTensor b(16 * kChunk, 2, stream), c(7 * kChunk + 64, 3, stream);
    std::thread thread_c;
    std::atomic<bool> c_done{false};

    struct Hook : BlockHook {
      std::function<void()> fn;
      int calls = 0;
      void before_block() override {
        ++calls;
        fn();
      }
    } hook;
    hook.fn = [&] {
      // The lane's batch was sealed just before this: every copy completes, the reader takes all.
      CHECK(wait_until([&] { return stager.completed(0) >= stager.submitted(0); }, 10), "copies did not complete");
      CHECK(wait_until([&] { return hdr->tail.load() == hdr->head.load(); }, 10), "reader did not catch up");
      const uint64_t waits = stager.stats().device_ring_full_waits;
      if (std::getenv("RING_CYCLE_DEBUG")) {
        CudaStagerStats s0 = stager.stats();
        std::fprintf(stderr, "hook: host head %llu tail %llu; device used %llu regions %llu; records %llu\n",
                     (unsigned long long)hdr->head.load(), (unsigned long long)hdr->tail.load(),
                     (unsigned long long)s0.devices[0].ring_used, (unsigned long long)s0.devices[0].in_flight_batches,
                     (unsigned long long)s0.records);
      }
      thread_c = std::thread([&] {
        status_c = stager.stage(3, 0, 1, 0, c.src, true, nullptr, 20.0);
        c_done = true;
      });
      // C has reserved its host records once it waits for device space (or has staged).
      CHECK(wait_until([&] { return c_done.load() || stager.stats().device_ring_full_waits > waits; }, 10),
            "C neither staged nor waited for the device ring");
      if (std::getenv("RING_CYCLE_DEBUG")) {
        CudaStagerStats s1 = stager.stats();
        std::fprintf(stderr, "hook end: c_done %d; host head %llu tail %llu; device used %llu regions %llu; waits %llu\n",
                     (int)c_done.load(), (unsigned long long)hdr->head.load(), (unsigned long long)hdr->tail.load(),
                     (unsigned long long)s1.devices[0].ring_used, (unsigned long long)s1.devices[0].in_flight_batches,
                     (unsigned long long)s1.device_ring_full_waits);
      }
    };
    const auto t0 = std::chrono::steady_clock::now();
    // The timeout bounds the cycle, should it be there: B then returns kTorn.
    status_b = stager.stage(2, 0, 1, 0, b.src, true, &hook, 3.0);
    seconds_b = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (thread_c.joinable()) thread_c.join();
    CHECK(hook.calls == 1, "B's first wait: before_block() called %d times", hook.calls);
    CHECK(stager.flush(10.0), "flush timed out");
    CHECK(wait_until([&] { return hdr->tail.load() == hdr->head.load(); }, 10), "reader did not catch up");

    // 2. `drop` waits for the ring's allocation lock (held by E, a blocking reservation waiting for
    // the writer) with no device space held: the same cycle, should a thread like C wait for it.
    paused = true;
    std::vector<uint8_t> host_bytes(6 * kChunk + 4 * kChunk, 0x5A);
    HostSource fill{host_bytes.data(), 1, {static_cast<int64_t>(6 * kChunk)}, {1}};
    CHECK(prod.stage_host(4, 0, 1, 0, fill, true) == kStaged, "fill");  // 6 records: 164,096 bytes left
    std::atomic<bool> e_started{false}, d_done{false};
    int status_e = -1, status_d = -1;
    std::thread thread_e([&] {
      HostSource big{host_bytes.data(), 1, {static_cast<int64_t>(4 * kChunk)}, {1}};
      e_started = true;
      status_e = prod.stage_host(4, 1, 1, 0, big, true);  // reserve_all waits for the writer, lock held
    });
    CHECK(wait_until([&] { return e_started.load(); }, 10), "E did not start");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    DevTensor d(4096, 5, stream);
    std::thread thread_d([&] {
      status_d = stager.stage(5, 0, 1, 0, d.src, false, nullptr);
      d_done = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CHECK(wait_until([&] { return stager.completed(0) >= stager.submitted(0); }, 10), "copies did not complete");
    const uint64_t held = stager.stats().devices[0].ring_used;
    CHECK(d_done.load() || held == 0,
          "a `drop` stage() waiting for the ring's lock holds %llu bytes of device ring",
          (unsigned long long)held);
    paused = false;
    thread_e.join();
    thread_d.join();
    CHECK(status_e == kStaged, "E returned %d", status_e);
    CHECK(status_d == kStaged || status_d == kDropped, "D returned %d", status_d);
    CHECK(stager.flush(10.0), "flush timed out");
    CudaStagerStats st = stager.stats();
    CHECK(st.last_error.empty(), "error: %s", st.last_error.c_str());
    stager.end_pass(lane);
    fdmock::stream_of(stream)->sync();
    stager.close();
    cudaStreamDestroy(stream);
    std::printf("B: status %d in %.3f s; C: status %d; records %llu published %llu cancelled %llu, device waits %llu, "
                "host waits %llu\n",
                status_b, seconds_b, status_c, (unsigned long long)st.records, (unsigned long long)st.published,
                (unsigned long long)st.cancelled, (unsigned long long)st.device_ring_full_waits,
                (unsigned long long)st.host_ring_full_waits);
    CHECK(status_b == kStaged,
          "B (a tensor larger than the host ring, staged record by record) returned %d after %.1f s: it held "
          "device-ring space while waiting for the host ring, whose writer waited for C, which waited for that space",
          status_b, seconds_b);
    CHECK(status_c == kStaged, "C returned %d", status_c);
    CHECK(wait_until([&] { return hdr->tail.load() == hdr->head.load(); }, 10), "reader did not finish");
    stop_reader = true;
    reader.join();
    CHECK(bytes_of(2, 0) == b.bytes, "B's bytes differ or are missing");
    CHECK(bytes_of(3, 0) == c.bytes, "C's bytes differ or are missing");
    for (uint32_t i = 0; i < 4; ++i) CHECK(bytes_of(1, i) == lean[i]->bytes, "lean tensor %u differs", i);
    for (DevTensor* t : lean) {
      cudaFree(t->buf);
      delete t;
    }
    cudaFree(b.buf);
    cudaFree(c.buf);
    cudaFree(d.buf);
  }
  if (reader.joinable()) {
    stop_reader = true;
    reader.join();
  }
  std::printf("failures %d\n", check_failures.load());
  return check_failures.load() ? 1 : 0;
}
