// Stress test of CUDA-graph record mode (csrc/cuda_graph_record.cu) against the mock runtime,
// without Python, so it can run under ThreadSanitizer (tests/cuda_mock/run_stress.sh).
//   ./a.out [replays_per_graph] [graphs]
// Each graph has its own Dumper channel (recorder), thread, capture stream (global or thread-local
// mode) and replay stream. Per replay the thread copies a fresh input into the graph's static input
// in stream order and launches the graph, never synchronizing; a pauser thread stops and restarts
// the drains so the small replay rings fill and replays are dropped. A reader thread reads the host
// ring like the writer: each replay is one span record (chunked when large), split by the graph's
// layout. Checks: every replay pass holds h1 = x + 1 and h2 = x + 2 (bytewise) of the input of the
// replay its header names, the header matches its record, passes arrive in replay order per
// channel, passes + dropped replays = replays, the drains' drop notes only grow and never exceed
// the final count, nothing torn.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "cuda_graph_record.h"
#include "cuda_runtime.h"
#include "cuda_staging.h"
#include "ring.h"

using namespace fastdump;

namespace {

uint8_t input_byte(int graph, uint64_t replay, uint64_t i) {
  return static_cast<uint8_t>(graph * 31 + replay * 7 + i * 13);
}

struct Pass {
  uint64_t replay = ~0ull;
  bool ended = false;
  std::map<uint32_t, std::vector<uint8_t>> tensors;
};

struct Span {  // a span record being assembled from its chunks
  std::vector<uint8_t> bytes;
  uint64_t filled = 0;
};

struct Layout {
  uint32_t name_id = 0;
  uint64_t span_bytes = 0;
  std::vector<GraphTensorLayout> tensors;
};

uint64_t json_uint(const std::string& s, const char* key) {
  const std::string k = std::string("\"") + key + "\":";
  const size_t p = s.find(k);
  return p == std::string::npos ? ~0ull : std::strtoull(s.c_str() + p + k.size(), nullptr, 10);
}

}  // namespace

int main(int argc, char** argv) {
  const int replays = argc > 1 ? std::atoi(argv[1]) : 200;
  const int ngraphs = argc > 2 ? std::atoi(argv[2]) : 3;
  fdmock::config().max_delay_us = 20;
  fdmock::config().device_count = 1;

  const std::string name = "/fdgstress-" + std::to_string(getpid());
  Producer prod(name, 2 << 20, 64 << 10);
  prod.region().unlink();
  RingHeader* hdr = prod.region().header();
  uint8_t* data = prod.region().data();
  const uint64_t cap = prod.region().capacity();

  std::vector<std::map<int64_t, Pass>> passes(static_cast<size_t>(ngraphs));
  std::vector<int64_t> last_begin(static_cast<size_t>(ngraphs), -1);
  std::vector<std::map<int64_t, Span>> spans(static_cast<size_t>(ngraphs));
  std::vector<uint64_t> noted(static_cast<size_t>(ngraphs), 0);  // the drains' drop notes, last seen
  std::mutex layout_mu;  // the graph's "graph message": set by its thread after end_graph
  std::vector<Layout> layouts(static_cast<size_t>(ngraphs));
  std::atomic<bool> stop_reader{false};
  std::thread reader([&] {
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
      const uint8_t* payload = reinterpret_cast<uint8_t*>(rec) + payload_offset(rec->ndim);
      const uint32_t ch = rec->channel;
      if (ch < static_cast<uint32_t>(ngraphs) && rec->kind == kControl) {
        const std::string msg(reinterpret_cast<const char*>(payload), rec->payload_len);
        CHECK(msg.find("\"op\":\"graph_drops\"") != std::string::npos, "channel %u: control %s", ch, msg.c_str());
        const uint64_t n = json_uint(msg, "dropped_passes");
        CHECK(n > noted[ch], "channel %u: drop note %llu after %llu", ch, (unsigned long long)n,
              (unsigned long long)noted[ch]);
        noted[ch] = n;
      } else if (ch < static_cast<uint32_t>(ngraphs) && rec->kind == kTensor) {
        CHECK(rec->dtype == kReplaySpanDtype, "channel %u: dtype %u", ch, (unsigned)rec->dtype);
        ChunkInfo chunk;
        std::memcpy(&chunk, reinterpret_cast<uint8_t*>(rec) + sizeof(RecordHeader), sizeof(chunk));
        Span& sp = spans[ch][rec->pass_id];
        if (sp.bytes.size() < chunk.total) sp.bytes.resize(chunk.total);
        std::memcpy(sp.bytes.data() + chunk.offset, payload, rec->payload_len);
        sp.filled += rec->payload_len;
        if (sp.filled == sp.bytes.size()) {  // whole: split it as the writer does
          Layout lay;
          {
            std::lock_guard<std::mutex> g(layout_mu);
            lay = layouts[ch];
          }
          ReplayHeader h;
          std::memcpy(&h, sp.bytes.data(), sizeof h);
          CHECK(h.magic == kReplayMagic && h.pass_id == static_cast<uint64_t>(rec->pass_id) &&
                    h.span_name_id == rec->name_id && h.span_name_id == lay.name_id &&
                    h.span_bytes == sp.bytes.size() && h.span_bytes == lay.span_bytes,
                "channel %u pass %lld: replay header does not match", ch, (long long)rec->pass_id);
          const int64_t pass = rec->pass_id;
          CHECK(pass > last_begin[ch], "channel %u: pass %lld after %lld", ch, (long long)pass,
                (long long)last_begin[ch]);
          last_begin[ch] = pass;
          Pass& p = passes[ch][pass];
          p.replay = h.replay;
          p.ended = true;
          for (const GraphTensorLayout& t : lay.tensors)
            if (t.offset + t.nbytes <= sp.bytes.size())
              p.tensors[t.name_id].assign(sp.bytes.begin() + static_cast<int64_t>(t.offset),
                                          sp.bytes.begin() + static_cast<int64_t>(t.offset + t.nbytes));
          spans[ch].erase(pass);
        }
      }
      hdr->tail.store(tail + rec->total_len, std::memory_order_release);
    }
  });

  std::vector<uint64_t> dropped(static_cast<size_t>(ngraphs), 0), sizes(static_cast<size_t>(ngraphs));
  {
    CudaStager stager(&prod, 1 << 20);
    stager.register_host();
    std::vector<std::unique_ptr<GraphRecorder>> recs;
    for (int g = 0; g < ngraphs; ++g)  // 16 KiB ring, 16 log entries: replays pile up while paused
      recs.emplace_back(new GraphRecorder(&stager, static_cast<uint32_t>(g), 0, 64 << 10, 16 << 10, 16,
                                          "{\"op\":\"graph_drops\",\"dropped_passes\":#}", "#"));
    std::atomic<bool> done{false};
    std::thread pauser([&] {
      unsigned k = 0;
      while (!done.load()) {
        recs[k % recs.size()]->set_paused(k % 2 == 0);
        std::this_thread::sleep_for(std::chrono::microseconds(300 + 97 * (k % 7)));
        ++k;
      }
      for (auto& r : recs) r->set_paused(false);
    });
    // Phases apart, as a server does: allocation (unsafe while another thread captures in global
    // mode: the mock refuses it like CUDA), captures, replays, teardown.
    std::atomic<int> arrived{0};
    auto barrier = [&](int phase) {
      arrived.fetch_add(1);
      while (arrived.load() < phase * ngraphs) std::this_thread::yield();
    };
    std::vector<std::thread> threads;
    for (int g = 0; g < ngraphs; ++g) {
      threads.emplace_back([&, g] {
        const uint64_t n = 256 + 256 * static_cast<uint64_t>(g);  // bytes per tensor
        sizes[static_cast<size_t>(g)] = n;
        cudaStream_t cs = nullptr, rs = nullptr;
        cudaStreamCreateWithFlags(&cs, 0);  // blocking, like torch's capture stream
        cudaStreamCreateWithFlags(&rs, cudaStreamNonBlocking);
        void *x, *h1, *h2;
        CHECK(cudaMalloc(&x, n) == cudaSuccess && cudaMalloc(&h1, n) == cudaSuccess &&
                  cudaMalloc(&h2, n) == cudaSuccess, "graph %d: cudaMalloc", g);
        std::vector<uint8_t*> inputs;
        for (int k = 0; k < replays; ++k) {
          void* h = nullptr;
          CHECK(cudaHostAlloc(&h, n, cudaHostAllocPortable) == cudaSuccess, "cudaHostAlloc");
          for (uint64_t i = 0; i < n; ++i) static_cast<uint8_t*>(h)[i] = input_byte(g, static_cast<uint64_t>(k), i);
          inputs.push_back(static_cast<uint8_t*>(h));
        }
        barrier(1);
        CHECK(cudaStreamBeginCapture(cs, g % 2 ? cudaStreamCaptureModeThreadLocal : cudaStreamCaptureModeGlobal) ==
                  cudaSuccess, "begin capture");
        auto add = [&](void* dst, void* src, int v) {
          fdmock::enqueue(cs, [=] {
            uint8_t* d = fdmock::dev_bytes(static_cast<uint8_t*>(dst));
            const uint8_t* s = fdmock::dev_bytes(static_cast<const uint8_t*>(src));
            for (uint64_t i = 0; i < n; ++i) d[i] = static_cast<uint8_t>(s[i] + v);
          });
        };
        CudaSource src;
        src.elem_size = 4;
        src.shape = {static_cast<int64_t>(n / 16), 4};
        src.strides = {4, 1};
        src.device = 0;
        src.stream = reinterpret_cast<uintptr_t>(cs);
        GraphRecorder& rec = *recs[static_cast<size_t>(g)];
        rec.begin_graph(reinterpret_cast<uintptr_t>(cs));
        add(h1, x, 1);
        src.ptr = reinterpret_cast<uintptr_t>(h1);
        CHECK(rec.record(0, 5, src) == kStaged, "record h1");
        add(h2, h1, 1);
        src.ptr = reinterpret_cast<uintptr_t>(h2);
        CHECK(rec.record(1, 5, src) == kStaged, "record h2");
        fdmock::enqueue(cs, [=] { std::memset(fdmock::dev_bytes(static_cast<uint8_t*>(h1)), 0xEE, n); });
        CHECK(rec.end_graph() == 0, "end_graph");
        {
          std::lock_guard<std::mutex> lk(layout_mu);
          layouts[static_cast<size_t>(g)] = Layout{rec.span_name_id(0), rec.span_bytes(0), rec.layout(0)};
        }
        cudaGraph_t graph = nullptr;
        CHECK(cudaStreamEndCapture(cs, &graph) == cudaSuccess, "end capture");
        cudaGraphExec_t exe = nullptr;
        CHECK(cudaGraphInstantiate(&exe, graph, 0) == cudaSuccess, "instantiate");
        barrier(2);
        for (int k = 0; k < replays; ++k) {
          CHECK(cudaMemcpyAsync(x, inputs[static_cast<size_t>(k)], n, cudaMemcpyHostToDevice, rs) == cudaSuccess,
                "input copy");
          CHECK(cudaGraphLaunch(exe, rs) == cudaSuccess, "launch");
        }
        CHECK(cudaStreamSynchronize(rs) == cudaSuccess, "sync");
        barrier(3);
        cudaGraphExecDestroy(exe);
        cudaGraphDestroy(graph);
        for (uint8_t* h : inputs) cudaFreeHost(h);
        cudaStreamDestroy(cs);
        cudaStreamDestroy(rs);
        // x, h1, h2 stay until the drain is done with nothing of theirs (the ring holds copies).
        cudaFree(x);
        cudaFree(h1);
        cudaFree(h2);
      });
    }
    for (auto& t : threads) t.join();
    done.store(true);
    pauser.join();
    for (int g = 0; g < ngraphs; ++g) {
      CHECK(recs[static_cast<size_t>(g)]->flush(30), "flush %d", g);
      GraphRecorderStats s = recs[static_cast<size_t>(g)]->stats();
      dropped[static_cast<size_t>(g)] = s.dropped_replays;
      CHECK(s.replays + s.dropped_replays == static_cast<uint64_t>(replays), "graph %d: %llu passes + %llu dropped != %d",
            g, (unsigned long long)s.replays, (unsigned long long)s.dropped_replays, replays);
      CHECK(!s.broken, "graph %d broken: %s", g, s.last_error.c_str());
      recs[static_cast<size_t>(g)]->close(30, true);  // the graph is destroyed: memory may go
    }
    CHECK(stager.flush(30), "stager flush");
    stager.close();
  }
  stop_reader.store(true);
  reader.join();

  uint64_t total = 0, total_dropped = 0, total_noted = 0;
  for (int g = 0; g < ngraphs; ++g) {
    const uint64_t n = sizes[static_cast<size_t>(g)];
    uint64_t prev = 0;
    bool first = true;
    for (auto& [pass, p] : passes[static_cast<size_t>(g)]) {
      CHECK(pass >= kGraphPassBase, "graph %d: pass %lld", g, (long long)pass);
      CHECK(p.ended && p.tensors.size() == 2, "graph %d pass %lld: ended %d, %zu tensors", g, (long long)pass, p.ended,
            p.tensors.size());
      CHECK(first || p.replay > prev, "graph %d: replay %llu after %llu", g, (unsigned long long)p.replay,
            (unsigned long long)prev);
      first = false;
      prev = p.replay;
      for (uint32_t t = 0; t < 2; ++t) {
        const auto& b = p.tensors[t];
        bool ok = b.size() == n;
        for (uint64_t i = 0; ok && i < n; ++i) ok = b[i] == static_cast<uint8_t>(input_byte(g, p.replay, i) + 1 + t);
        CHECK(ok, "graph %d replay %llu tensor %u: wrong bytes", g, (unsigned long long)p.replay, t);
      }
    }
    total += passes[static_cast<size_t>(g)].size();
    total_dropped += dropped[static_cast<size_t>(g)];
    total_noted += noted[static_cast<size_t>(g)];
    CHECK(passes[static_cast<size_t>(g)].size() + dropped[static_cast<size_t>(g)] == static_cast<uint64_t>(replays),
          "graph %d: %zu passes read + %llu dropped != %d", g, passes[static_cast<size_t>(g)].size(),
          (unsigned long long)dropped[static_cast<size_t>(g)], replays);
    CHECK(noted[static_cast<size_t>(g)] <= dropped[static_cast<size_t>(g)], "graph %d: noted %llu drops of %llu", g,
          (unsigned long long)noted[static_cast<size_t>(g)], (unsigned long long)dropped[static_cast<size_t>(g)]);
    CHECK(spans[static_cast<size_t>(g)].empty(), "graph %d: %zu span records never completed", g,
          spans[static_cast<size_t>(g)].size());
  }
  CHECK(fdmock::config().live_allocs.load() == 0, "device memory leaked: %lld blocks",
        (long long)fdmock::config().live_allocs.load());
  std::printf("graph stress: %d graphs x %d replays: %llu passes, %llu dropped (%llu in drop notes), %d errors\n",
              ngraphs, replays, (unsigned long long)total, (unsigned long long)total_dropped,
              (unsigned long long)total_noted, check_failures.load());
  return check_failures.load() ? 1 : 0;
}
