// Stress test of csrc/cuda_staging.cu against the mock CUDA runtime, without Python, so it can run
// under ThreadSanitizer (tests/cuda_mock/run_stress.sh builds and runs it both ways):
//   g++ -std=c++17 -O1 -g -fsanitize=thread -DFASTDUMP_CUDA_MOCK=1 -Itests/cuda_mock -Icsrc
//       -x c++ csrc/cuda_staging.cu -x none csrc/ring.cpp tests/cuda_mock/stress.cpp -lrt -pthread
//   ./a.out [iterations_per_thread] [threads] [mode]
// Odd threads stage through the lean path (stage_lean, a lane each, passes of 7 tensors, events
// every N, pass ends sometimes left to the drain's timer).
// mode "fail": a CUDA error in the drain halfway (stage() must then return kDisabled, nothing may
// hang, and what was delivered must still be right); mode "nobatch": cudaMemcpyBatchAsync refused.
// Several threads stage random strided tensors (random element sizes, shapes, strides, block or
// drop) on their own streams and devices, while "kernels" on those streams produce each tensor
// before the hook and overwrite it right after. A consumer thread reads the ring like the writer.
// Checks: every STAGED tensor arrives complete and equal to its value at hook time; DROPPED ones
// leave no record; each thread's tensors arrive in staging order; counters add up; nothing leaks.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "cuda_runtime.h"
#include "cuda_staging.h"
#include "ring.h"
#include "strided_copy.h"

using namespace fastdump;

namespace {

struct Expect {
  std::vector<uint8_t> bytes;
  int status = -1;
};

struct Got {
  std::vector<uint8_t> bytes;
  uint64_t filled = 0;
  uint64_t total = 0;
  bool any = false;
};

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 200;
  const int nthreads = argc > 2 ? std::atoi(argv[2]) : 4;
  const std::string mode = argc > 3 ? argv[3] : "";
  const bool fail_mode = mode == "fail";
  if (mode == "nobatch") fdmock::inject("cudaMemcpyBatchAsync", 1 << 30, cudaErrorNotSupported);
  std::atomic<bool> failed{false};
  fdmock::config().max_delay_us = 30;
  fdmock::config().device_count = 2;
  setenv("FASTDUMP_CUDA_REGISTER_PIECE_MB", "1", 1);

  const std::string name = "/fdstress-" + std::to_string(getpid());
  Producer prod(name, 3 << 20, 64 << 10);  // small rings: lots of waiting, wrapping, chunking
  prod.region().unlink();
  // The reader follows Consumer::next/release through the producer's own mapping: a second
  // mapping (what Consumer does) has other addresses, which hides the tail hand-off from TSAN.
  RingHeader* hdr = prod.region().header();
  uint8_t* data = prod.region().data();
  const uint64_t cap = prod.region().capacity();

  std::map<std::pair<uint32_t, uint32_t>, Got> got;  // (channel, name_id)
  std::vector<uint32_t> last_name(static_cast<size_t>(nthreads), 0);
  std::atomic<bool> stop_reader{false};
  std::thread reader([&] {
    std::mt19937 rng(7);
    RecordView v;
    for (;;) {
      const uint64_t tail = hdr->tail.load(std::memory_order_relaxed);
      if (tail == hdr->head.load(std::memory_order_acquire)) {
        if (stop_reader.load()) break;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      auto* rec = reinterpret_cast<RecordHeader*>(data + tail % cap);
      if (rec->state.load(std::memory_order_acquire) != kReady) {
        std::this_thread::yield();
        continue;
      }
      const uint64_t rec_len = rec->total_len;
      v.kind = rec->kind;
      v.channel = rec->channel;
      v.name_id = rec->name_id;
      std::memcpy(&v.chunk, reinterpret_cast<uint8_t*>(rec) + sizeof(RecordHeader), sizeof(ChunkInfo));
      v.payload = reinterpret_cast<uint8_t*>(rec) + payload_offset(rec->ndim);
      v.payload_len = rec->payload_len;
      if (v.kind == kTensor) {
        Got& g = got[{v.channel, v.name_id}];
        if (!g.any) {
          g.any = true;
          g.total = v.chunk.total;
          g.bytes.assign(v.chunk.total, 0);
          CHECK(v.name_id >= last_name[v.channel], "thread %u: tensor %u after %u", v.channel, v.name_id,
                last_name[v.channel]);
          last_name[v.channel] = v.name_id;
        }
        CHECK(v.chunk.offset + v.payload_len <= g.total, "chunk out of range");
        if (v.chunk.offset + v.payload_len <= g.total)
          std::memcpy(g.bytes.data() + v.chunk.offset, v.payload, v.payload_len);
        g.filled += v.payload_len;
      }
      if (rng() % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));  // slow writer
      hdr->tail.store(tail + rec_len, std::memory_order_release);
    }
  });

  std::vector<std::map<uint32_t, Expect>> expect(static_cast<size_t>(nthreads));
  {
    CudaStager stager(&prod, 512 << 10);
    stager.register_host();
    std::vector<std::thread> threads;
    for (int t = 0; t < nthreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(static_cast<unsigned>(100 + t));
        // Every other thread stages through a lean lane (stage_lean), half of those on the
        // tensors' device (lean) and half not (each tensor then takes the checked path).
        CudaLane* lane = t % 2 == 1 ? stager.open_lane() : nullptr;
        cudaStream_t stream = nullptr;
        fdmock::current_device() = t % 2;
        cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, 0);
        if (lane && t % 4 == 3) fdmock::current_device() = (t + 1) % 2;  // not the tensors' device
        std::vector<std::vector<uint8_t>*> keep;
        std::vector<void*> device_bufs;
        const uint64_t sizes[] = {1, 2, 4, 8, 16, 3, 12};
        for (int i = 0; i < iters; ++i) {
          const uint64_t elem = sizes[rng() % 7];
          const int nd = static_cast<int>(rng() % 5);  // 0..4 dims
          // A base array, then a view: random permutation, step slicing, offsets, broadcasts.
          std::vector<int64_t> base_shape(static_cast<size_t>(nd));
          for (auto& d : base_shape) d = 1 + static_cast<int64_t>(rng() % (rng() % 8 == 0 ? 300 : 12));
          std::vector<int64_t> base_strides(static_cast<size_t>(nd));
          int64_t n = 1;
          for (int k = nd - 1; k >= 0; --k) {
            base_strides[static_cast<size_t>(k)] = n;
            n *= base_shape[static_cast<size_t>(k)];
          }
          std::vector<int64_t> shape = base_shape, strides = base_strides;
          int64_t offset = 0;
          for (int k = 0; k < nd; ++k) {
            const size_t kk = static_cast<size_t>(k);
            switch (rng() % 5) {
              case 0: {  // step slice
                int64_t step = 1 + static_cast<int64_t>(rng() % 3);
                shape[kk] = (base_shape[kk] + step - 1) / step;
                strides[kk] *= step;
                break;
              }
              case 1:  // reversed (negative stride)
                offset += (base_shape[kk] - 1) * base_strides[kk];
                strides[kk] = -base_strides[kk];
                break;
              case 2:  // broadcast
                strides[kk] = 0;
                break;
              default:
                break;
            }
          }
          if (nd >= 2 && rng() % 2) {
            std::swap(shape[0], shape[static_cast<size_t>(nd - 1)]);
            std::swap(strides[0], strides[static_cast<size_t>(nd - 1)]);
          }
          if (rng() % 50 == 0 && nd > 0) shape[0] = 0;  // empty tensor
          // The tensor lives in (mock) device memory; the host cannot touch it, only stream work can.
          const size_t nbytes = static_cast<size_t>(n) * elem;
          void* dbuf = nullptr;
          CHECK(cudaMalloc(&dbuf, nbytes) == cudaSuccess, "cudaMalloc");
          device_bufs.push_back(dbuf);
          uint8_t* buf = static_cast<uint8_t*>(dbuf);
          auto* produced = new std::vector<uint8_t>(nbytes);
          for (auto& b : *produced) b = static_cast<uint8_t>(rng());
          keep.push_back(produced);
          const uint8_t* ptr = buf + offset * static_cast<int64_t>(elem);
          // On the stream, before the hook: (sometimes a slow kernel, then) the kernel producing
          // the tensor. The snapshot must see these bytes, not the zeros there now.
          if (rng() % 4 == 0) fdmock::enqueue(stream, [] { std::this_thread::sleep_for(std::chrono::microseconds(300)); });
          fdmock::enqueue(stream, [buf, produced] { std::memcpy(fdmock::dev_bytes(buf), produced->data(), produced->size()); });
          Expect e;
          uint64_t numel = 1;
          for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
          e.bytes.resize(numel * elem);
          copy_strided(e.bytes.data(), produced->data() + offset * static_cast<int64_t>(elem), elem, shape, strides, 0,
                       numel);
          CudaSource src;
          src.ptr = reinterpret_cast<uintptr_t>(ptr);
          src.elem_size = elem;
          src.shape = shape;
          src.strides = strides;
          src.device = t % 2;
          src.stream = reinterpret_cast<uintptr_t>(stream);
          const bool block = t % 2 == 0 || rng() % 2;
          if (fail_mode && t == 0 && i == iters / 2) {
            fdmock::inject("cudaEventQuery", 1, cudaErrorUnknown);
            failed = true;
          }
          if (lane) {
            // The lean path: passes of 7 tensors; some pass ends are left to the drain's timer.
            e.status = stager.stage_lean(lane, static_cast<uint32_t>(t), static_cast<uint32_t>(i), 1 + i / 7, 0, src,
                                         block, nullptr);
            if (i % 7 == 6 && rng() % 3) stager.end_pass(lane);
          } else {
            e.status = stager.stage(static_cast<uint32_t>(t), static_cast<uint32_t>(i), 1, 0, src, block, nullptr);
          }
          // Under `drop` a tensor that cannot fit in the ring at once is never staged (kRingTooSmall).
          if (!failed.load())
            CHECK(e.status == kStaged || (!block && (e.status == kDropped || e.status == kRingTooSmall)),
                  "thread %d tensor %d: status %d", t, i, e.status);
          // After the hook: the next kernel overwrites the tensor in place.
          fdmock::enqueue(stream, [buf, nbytes] { std::memset(fdmock::dev_bytes(buf), 0xEE, nbytes); });
          expect[static_cast<size_t>(t)][static_cast<uint32_t>(i)] = std::move(e);
        }
        // A stream must outlive the pass that staged on it: the pass end records the lane's last
        // event on it (docs/CUDA.md, "The eager path").
        if (lane) stager.end_pass(lane);
        fdmock::stream_of(stream)->sync();
        cudaStreamDestroy(stream);
        for (void* b : device_bufs) cudaFree(b);
        for (auto* b : keep) delete b;
      });
    }
    for (auto& th : threads) th.join();
    CHECK(stager.flush(30.0), "flush timed out");
    CudaStagerStats st = stager.stats();
    ProducerStats ps = prod.stats();
    std::printf("tensors %llu records %llu snapshots %llu (kernels %llu, 2d %llu) d2h copies %llu in %llu batches, "
                "dropped %llu, device waits %llu, host waits %llu, cancelled %llu\n",
                (unsigned long long)st.tensors, (unsigned long long)st.records, (unsigned long long)st.snapshots,
                (unsigned long long)st.snapshot_kernels, (unsigned long long)st.snapshot_2d,
                (unsigned long long)st.d2h_copies, (unsigned long long)st.d2h_batches,
                (unsigned long long)st.dropped, (unsigned long long)st.device_ring_full_waits,
                (unsigned long long)st.host_ring_full_waits, (unsigned long long)st.cancelled);
    if (nthreads >= 2) CHECK(st.lean_tensors > 0, "no tensor took the lean path");
    CHECK(st.dropped == ps.dropped, "dropped %llu vs producer %llu", (unsigned long long)st.dropped,
          (unsigned long long)ps.dropped);
    CHECK(st.published + st.cancelled >= st.records, "published %llu + cancelled %llu of %llu",
          (unsigned long long)st.published, (unsigned long long)st.cancelled, (unsigned long long)st.records);
    if (fail_mode) {
      CHECK(!st.last_error.empty(), "no error recorded");
      CudaSource src;
      uint8_t byte = 0;
      src.ptr = reinterpret_cast<uintptr_t>(&byte);
      src.elem_size = 1;
      CHECK(stager.stage(0, 99999, 1, 0, src, true, nullptr) == kDisabled, "stage after failure not disabled");
    } else {
      CHECK(st.cancelled == 0, "cancelled %llu", (unsigned long long)st.cancelled);
      CHECK(st.published == st.records, "published %llu of %llu", (unsigned long long)st.published,
            (unsigned long long)st.records);
      if (mode == "nobatch")
        CHECK(!st.batch_api && st.batch_api_fallback.find("cudaMemcpyBatchAsync") != std::string::npos,
              "no fallback: %s", st.batch_api_fallback.c_str());
      else CHECK(st.batch_api_fallback.empty(), "fallback: %s", st.batch_api_fallback.c_str());
      CHECK(st.last_error.empty(), "error: %s", st.last_error.c_str());
    }
    stager.close();
  }
  // Wait for the reader to drain what is left.
  for (int i = 0; i < 400; ++i) {
    RingHeader* h = prod.region().header();
    if (h->head.load() == h->tail.load()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop_reader = true;
  reader.join();

  uint64_t staged = 0, dropped = 0;
  for (int t = 0; t < nthreads; ++t) {
    for (auto& kv : expect[static_cast<size_t>(t)]) {
      const Expect& e = kv.second;
      auto it = got.find({static_cast<uint32_t>(t), kv.first});
      if (e.status == kDropped || e.status == kRingTooSmall || e.status == kDisabled) {
        dropped++;
        // kDisabled after a failure may leave the chunks published before it (a torn tensor).
        CHECK(it == got.end() || (fail_mode && e.status == kDisabled), "thread %d tensor %u not staged but has records",
              t, kv.first);
        continue;
      }
      staged++;
      if (fail_mode) {  // after the failure a staged tensor may be lost or torn, never wrong
        if (it == got.end() || it->second.filled != e.bytes.size()) continue;
        CHECK(it->second.bytes == e.bytes, "thread %d tensor %u: content differs", t, kv.first);
        continue;
      }
      CHECK(it != got.end(), "thread %d tensor %u missing", t, kv.first);
      if (it == got.end()) continue;
      CHECK(it->second.filled == e.bytes.size(), "thread %d tensor %u: %llu of %zu bytes", t, kv.first,
            (unsigned long long)it->second.filled, e.bytes.size());
      if (it->second.bytes != e.bytes) {
        size_t k = 0, bad = 0;
        while (it->second.bytes[k] == e.bytes[k]) ++k;
        for (size_t j = 0; j < e.bytes.size(); ++j) bad += it->second.bytes[j] != e.bytes[j];
        CHECK(false, "thread %d tensor %u: content differs (%zu of %zu bytes, first at %zu: %02x, want %02x)", t,
              kv.first, bad, e.bytes.size(), k, it->second.bytes[k], e.bytes[k]);
      }
    }
  }
  auto& c = fdmock::config();
  CHECK(c.crossing_copies.load() == 0, "%llu copies crossed registrations", (unsigned long long)c.crossing_copies.load());
  CHECK(c.unpinned_copies.load() == 0, "%llu copies into unpinned memory", (unsigned long long)c.unpinned_copies.load());
  CHECK(c.live_allocs.load() == 0 && c.live_events.load() == 0 && c.registered_ranges.load() == 0,
        "leak: allocs %llu events %llu registrations %llu", (unsigned long long)c.live_allocs.load(),
        (unsigned long long)c.live_events.load(), (unsigned long long)c.registered_ranges.load());
  std::printf("staged %llu dropped %llu, batch calls %llu, failures %d\n", (unsigned long long)staged,
              (unsigned long long)dropped, (unsigned long long)c.batch_calls.load(), check_failures.load());
  return check_failures.load() ? 1 : 0;
}
