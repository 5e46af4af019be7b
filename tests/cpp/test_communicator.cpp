// Communicator end to end with ranks as threads of one process (the shm transport maps the
// same segments several times): every op on random data against references, chunked sizes,
// p2p tags out of order, the proxy path, the tcp transport, mismatch detection and timeouts.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/communicator.hpp"
#include "core/error.hpp"

using namespace resident;

class MemoryStore : public BootstrapStore {
 public:
  void set(const std::string& k, const std::string& v) override {
    std::lock_guard<std::mutex> g(mu_);
    kv_[k] = v;
    cv_.notify_all();
  }
  std::string get(const std::string& k) override {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait(g, [&] { return kv_.count(k) != 0; });
    return kv_[k];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

std::vector<float> randomFloats(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  return v;
}

void runRanks(int n, const Config& cfg, uint64_t timeout_ms,
              const std::function<void(Communicator&)>& body) {
  MemoryStore store;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        Communicator comm(store, r, n, cfg, timeout_ms);
        body(comm);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (!errors[static_cast<size_t>(r)].empty()) {
      std::fprintf(stderr, "rank %d: %s\n", r, errors[static_cast<size_t>(r)].c_str());
      CHECK(false);
    }
  }
}

void testCollectives(const Config& cfg, int n) {
  runRanks(n, cfg, 20000, [&](Communicator& c) {
    const int r = c.rank();
    Engine& e = c.engine();
    auto run = [&](OpHandle h) {
      e.wait(h);
      e.release(h);
    };
    for (size_t count : {size_t(1), size_t(2), size_t(1000), size_t(40000)}) {  // 40000 > slot
      std::vector<float> out(count);
      auto in = randomFloats(100 + r, count);
      run(c.allReduce(in.data(), out.data(), count, DType::kFloat32, RedOp::kSum));
      std::vector<std::vector<float>> all;
      for (int p = 0; p < n; ++p) all.push_back(randomFloats(100 + p, count));
      for (size_t i = 0; i < count; ++i) {
        float ref = all[0][i];
        for (int p = 1; p < n; ++p) ref += all[p][i];
        CHECK(out[i] == ref);
      }
      // all_gather into one buffer.
      std::vector<float> gathered(count * n);
      std::vector<void*> outs(n);
      for (int p = 0; p < n; ++p) outs[p] = gathered.data() + p * count;
      run(c.allGather(in.data(), outs.data(), count * 4));
      for (int p = 0; p < n; ++p) CHECK(std::memcmp(outs[p], all[p].data(), count * 4) == 0);
      // broadcast from the last rank.
      std::vector<float> b = r == n - 1 ? in : std::vector<float>(count, 7.0f);
      run(c.broadcast(b.data(), count * 4, n - 1));
      CHECK(std::memcmp(b.data(), all[n - 1].data(), count * 4) == 0);
      // reduce_scatter (MAX): block r of everyone.
      std::vector<float> rs_in = randomFloats(200 + r, count * n), rs_out(count);
      run(c.reduceScatter(rs_in.data(), rs_out.data(), count, DType::kFloat32, RedOp::kMax));
      for (size_t i = 0; i < count; ++i) {
        float ref = -1e30f;
        for (int p = 0; p < n; ++p)
          ref = std::max(ref, randomFloats(200 + p, count * n)[r * count + i]);
        CHECK(rs_out[i] == ref);
        if (i > 8) break;  // the reference regeneration is slow; first elements suffice here
      }
    }
    // Uneven all_to_all: rank r sends (r + p) % 3 * 1000 + 1 bytes to p.
    std::vector<std::vector<unsigned char>> sendb(n), recvb(n);
    std::vector<const void*> ins(n);
    std::vector<void*> outs(n);
    std::vector<size_t> inb(n), outb(n);
    for (int p = 0; p < n; ++p) {
      inb[p] = ((r + p) % 3) * 30000 + (p == 0 ? 0 : 1);
      outb[p] = ((p + r) % 3) * 30000 + (r == 0 ? 0 : 1);
      sendb[p].resize(inb[p]);
      for (size_t i = 0; i < inb[p]; ++i)
        sendb[p][i] = static_cast<unsigned char>(r * 31 + p * 7 + i);
      recvb[p].resize(outb[p]);
      ins[p] = sendb[p].data();
      outs[p] = recvb[p].data();
    }
    run(c.allToAll(ins.data(), inb.data(), outs.data(), outb.data()));
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < outb[p]; ++i)
        CHECK(recvb[p][i] == static_cast<unsigned char>(p * 31 + r * 7 + i));
    run(c.barrier());
    // P2P ring 0 -> 1 with tags in opposite order, one of them chunked.
    if (n >= 2 && r < 2) {
      std::vector<unsigned char> big(200000), small(10);
      for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<unsigned char>(i * 13);
      for (size_t i = 0; i < small.size(); ++i) small[i] = static_cast<unsigned char>(i + 1);
      if (r == 0) {
        auto h1 = c.send(big.data(), big.size(), 1, 5);
        auto h2 = c.send(small.data(), small.size(), 1, 9);
        run(h1);
        run(h2);
      } else {
        std::vector<unsigned char> gb(big.size()), gs(small.size());
        auto h1 = c.recv(gs.data(), gs.size(), 0, 9);
        run(h1);
        auto h2 = c.recv(gb.data(), gb.size(), 0, 5);
        run(h2);
        CHECK(gb == big);
        CHECK(gs == small);
      }
    }
    run(c.barrier());
  });
}

// Recv from any source: rank 0 takes every other rank's messages (one within a slot, one
// streamed through several) without naming the sender, posted before and after they arrive; each
// comes from a real sender with that sender's bytes, and sourceOf names it. Then the monitored
// barrier passes, and with the last rank missing rank 0 names it and rank 1 learns it failed.
void testAnySourceAndMonitoredBarrier(const Config& cfg, int n) {
  runRanks(n, cfg, 20000, [&](Communicator& c) {
    const int r = c.rank();
    Engine& e = c.engine();
    const size_t sizes[2] = {100, 40000};  // 40000 > slot
    auto pattern = [](int sender, int msg, size_t k) {
      return static_cast<unsigned char>(sender * 31 + msg * 7 + k);
    };
    for (int msg = 0; msg < 2; ++msg) {
      const uint64_t tag = 4 + static_cast<uint64_t>(msg);
      if (r == 0) {
        if (msg == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // stashed
        std::vector<int> seen(static_cast<size_t>(n), 0);
        for (int i = 1; i < n; ++i) {
          std::vector<unsigned char> buf(sizes[msg]);
          OpHandle h = c.recvAnySource(buf.data(), buf.size(), tag);
          e.wait(h);
          const int src = Communicator::sourceOf(h);
          e.release(h);
          CHECK(src >= 1 && src < n && seen[static_cast<size_t>(src)]++ == 0);
          for (size_t k = 0; k < buf.size(); ++k) CHECK(buf[k] == pattern(src, msg, k));
        }
      } else {
        std::vector<unsigned char> buf(sizes[msg]);
        for (size_t k = 0; k < buf.size(); ++k) buf[k] = pattern(r, msg, k);
        OpHandle h = c.send(buf.data(), buf.size(), 0, tag);
        e.wait(h);
        e.release(h);
      }
    }
    c.monitoredBarrier(5000, false);
    c.monitoredBarrier(5000, true);
    std::string error;
    if (r != n - 1) {
      try {
        c.monitoredBarrier(300, false);
      } catch (const CommError& err) {
        error = err.what();
      }
      const std::string expected =
          r == 0 ? "Rank " + std::to_string(n - 1) + " failed to pass monitoredBarrier in 300 ms"
                 : "successfully reached monitoredBarrier";
      CHECK(error.find(expected) != std::string::npos);
    }
  });
}

// Rank 0 of a group of 2 whose rank 1 joins and then only sleeps for `silent_ms`; `body` gets
// rank 0's communicator and a 1-float all_reduce it started (the group's timeout: 300 ms).
void withSilentPeer(const Config& cfg, int silent_ms,
                    const std::function<void(Communicator&, OpHandle)>& body) {
  MemoryStore store;
  std::thread peer([&] {
    Communicator comm(store, 1, 2, cfg, 300);
    std::this_thread::sleep_for(std::chrono::milliseconds(silent_ms));
  });
  {
    Communicator comm(store, 0, 2, cfg, 300);
    float x = 1, y = 0;
    body(comm, comm.allReduce(&x, &y, 1, DType::kFloat32, RedOp::kSum));
  }
  peer.join();
}

// A completion callback runs however its op finishes. Here the proxy thread finishes every op
// (the callers do not wait in the engine; they watch a counter the callbacks bump) while another
// thread keeps taking the engine (setCompletionCallback on a finished op). The proxy's
// runCallbacks then often finds the engine taken and leaves the callbacks to its holder, which
// must run them as it lets go: otherwise they wait for a progress pass that never comes (no op
// is in flight), and a work's future never completes.
void testCallbacksOfOpsTheProxyFinishes(const Config& cfg, int rounds) {
  runRanks(2, cfg, 20000, [&](Communicator& c) {
    Engine& e = c.engine();
    float one = 1, two = 0;
    const OpHandle finished = c.allReduce(&one, &two, 1, DType::kFloat32, RedOp::kSum);
    e.wait(finished);  // stays finished and unreleased: what the other thread registers on
    std::atomic<bool> stop{false};
    std::thread holder([&] {
      while (!stop.load(std::memory_order_relaxed))
        e.setCompletionCallback(
            finished, [](void*) {}, nullptr);
    });
    std::atomic<int> fired{0};
    for (int i = 0; i < rounds; ++i) {
      float x = static_cast<float>(i + c.rank()), y = 0;
      const OpHandle h = c.allReduce(&x, &y, 1, DType::kFloat32, RedOp::kSum);
      e.setCompletionCallback(
          h, [](void* n) { static_cast<std::atomic<int>*>(n)->fetch_add(1); }, &fired);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (fired.load() != i + 1 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
      if (fired.load() != i + 1) {
        std::fprintf(stderr, "rank %d: the callback of op %d did not run within 5 s\n", c.rank(),
                     i);
        CHECK(false);
      }
      CHECK(y == static_cast<float>(2 * i + 1));
      e.release(h);
    }
    stop.store(true);
    holder.join();
    e.release(finished);
  });
}

int main() {
  Config cfg = Config::fromEnvironment();
  cfg.slot_bytes = 16384;  // small slots: exercise chunking and ring wrap-around
  testCollectives(cfg, 3);
  std::puts("test_communicator: direct ok");
  Config proxied = cfg;
  proxied.path = PathMode::kProxy;
  testCollectives(proxied, 2);
  std::puts("test_communicator: proxy ok");
  Config tcp = cfg;
  tcp.transport = "tcp";  // every peer over tcp, through the proxy, on this host
  testCollectives(tcp, 3);
  std::puts("test_communicator: tcp ok");
  // The automatic chunk of the CUDA rounds, and a segment that holds the GPU region at it: over
  // tcp the segment is made at the host chunk first, then again at 256 KiB.
  for (const char* transport : {"auto", "tcp"}) {
    Config gpu = cfg;
    gpu.gpu_region = true;
    gpu.transport = transport;
    const uint32_t want = std::string(transport) == "tcp" ? 262144u : 65536u;
    runRanks(2, gpu, 20000, [&](Communicator& c) {
      CHECK(c.config().gpu_chunk_bytes == want && c.gpuLayout().chunk == want);
      CHECK(c.segmentBytes() == c.gpuRegionOffset() + c.gpuLayout().totalBytes());
      std::vector<float> a(4096, 1.0f + static_cast<float>(c.rank())), b(a.size());
      c.engine().wait(c.allReduce(a.data(), b.data(), a.size(), DType::kFloat32, RedOp::kSum));
      CHECK(b[0] == 3.0f && b[4095] == 3.0f);
    });
  }
  std::puts("test_communicator: automatic CUDA chunk ok");
  // A peer that leaves in order (shuts its group down) gets its bit in the others' GPU region
  // (GpuLayout::kPeersLeftWord), where a CUDA kernel still waiting for it reads it and gives up.
  for (const char* transport : {"auto", "tcp"}) {
    Config gpu = cfg;
    gpu.gpu_region = true;
    gpu.transport = transport;
    // Ranks that read the word while nobody had left (rank 2 leaves only after all three did),
    // and survivors that saw rank 2's bit (neither leaves before both did).
    std::atomic<int> clean{0}, seen{0};
    auto waitFor = [](const std::atomic<int>& n, int want) {
      while (n.load() < want) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
    runRanks(3, gpu, 20000, [&](Communicator& c) {
      std::vector<float> a(64, 1.0f), b(a.size());
      c.engine().wait(c.allReduce(a.data(), b.data(), a.size(), DType::kFloat32, RedOp::kSum));
      const auto* left = reinterpret_cast<const uint64_t*>(c.segmentBase() + c.gpuRegionOffset() +
                                                           GpuLayout::kPeersLeftWord);
      CHECK(__atomic_load_n(left, __ATOMIC_ACQUIRE) == 0);
      clean.fetch_add(1);
      if (c.rank() == 2) {
        waitFor(clean, 3);
        c.shutdown();
        return;
      }
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (__atomic_load_n(left, __ATOMIC_ACQUIRE) == 0 &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      CHECK(__atomic_load_n(left, __ATOMIC_ACQUIRE) == uint64_t{1} << 2);
      seen.fetch_add(1);
      waitFor(seen, 2);
    });
  }
  std::puts("test_communicator: a peer that left is marked for the kernels ok");
  testAnySourceAndMonitoredBarrier(cfg, 3);
  testAnySourceAndMonitoredBarrier(proxied, 2);
  std::puts("test_communicator: any-source recv and monitored barrier ok");
  testCallbacksOfOpsTheProxyFinishes(proxied, 4000);
  testCallbacksOfOpsTheProxyFinishes(tcp, 300);
  std::puts("test_communicator: callbacks of ops the proxy finishes ok");

  // Mismatched sizes: both ranks raise a mismatch error, nobody hangs.
  std::vector<std::string> errors(2);
  {
    MemoryStore store;
    std::vector<std::thread> th;
    for (int r = 0; r < 2; ++r) {
      th.emplace_back([&, r] {
        Communicator comm(store, r, 2, cfg, 5000);
        std::vector<float> a(r == 0 ? 4 : 8, 1.5f), b(a.size());
        try {
          auto h = comm.allReduce(a.data(), b.data(), a.size(), DType::kFloat32, RedOp::kSum);
          comm.engine().wait(h);
        } catch (const CommError& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : th) t.join();
  }
  for (auto& e : errors) CHECK(e.find("size mismatch") != std::string::npos);

  // A peer that never calls: the op times out naming it.
  {
    std::string err;
    withSilentPeer(cfg, 800, [&](Communicator& comm, OpHandle h) {
      try {
        comm.engine().wait(h);
      } catch (const TimeoutError& e) {
        err = e.what();
      }
      CHECK_THROWS(comm.barrier());  // the group is unusable after the timeout
    });
    CHECK(err.find("rank 1") != std::string::npos);
  }
  // A waiter that cannot run a progress pass (another thread holds the engine: here a begun op
  // never committed) still gives up past the group's timeout, saying so, instead of spinning.
  {
    std::string err;
    withSilentPeer(cfg, 7000, [&](Communicator& comm, OpHandle h) {
      std::mutex mu;
      std::condition_variable cv;
      bool held = false, done = false;
      std::thread holder([&] {
        Op* op = comm.engine().begin();  // returns with the engine locked
        {
          std::unique_lock<std::mutex> g(mu);
          held = true;
          cv.notify_all();
          cv.wait(g, [&] { return done; });
        }
        comm.engine().abandon(op);  // unlocks
      });
      {
        std::unique_lock<std::mutex> g(mu);
        cv.wait(g, [&] { return held; });
      }
      const auto t0 = std::chrono::steady_clock::now();
      try {
        comm.engine().wait(h);
      } catch (const TimeoutError& e) {
        err = e.what();
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      {
        std::lock_guard<std::mutex> g(mu);
        done = true;
        cv.notify_all();
      }
      holder.join();
      CHECK(s < 6.5);
    });
    CHECK(err.find("past the group's timeout") != std::string::npos);
    CHECK(err.find("could not take the group's engine") != std::string::npos);
  }
  // A handle whose op was released is an error, not a wait without end.
  {
    MemoryStore store;
    Communicator comm(store, 0, 1, cfg, 300);
    float x = 1, y = 0;
    auto h = comm.allReduce(&x, &y, 1, DType::kFloat32, RedOp::kSum);
    comm.engine().wait(h);
    comm.engine().release(h);
    CHECK_THROWS(comm.engine().wait(h));
  }
  // A callback set on the handle of a released op whose slot started another op since runs at
  // once: that op finished; the slot's new one (here waiting for rank 1) does not take it.
  runRanks(2, cfg, 20000, [&](Communicator& c) {
    Engine& e = c.engine();
    float x = 1, y = 0;
    const OpHandle first = c.allReduce(&x, &y, 1, DType::kFloat32, RedOp::kSum);
    e.wait(first);
    e.release(first);
    if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const OpHandle second = c.allReduce(&x, &y, 1, DType::kFloat32, RedOp::kSum);
    if (c.rank() == 0) {
      CHECK(second.op == first.op);  // the slot of the released op, taken again
      std::atomic<int> fired{0};
      e.setCompletionCallback(
          first, [](void* n) { static_cast<std::atomic<int>*>(n)->fetch_add(1); }, &fired);
      CHECK(fired.load() == 1);
      CHECK(!e.test(second));  // rank 1 has not joined it yet
    }
    e.wait(second);
    e.release(second);
  });
  CHECK_THROWS(Config::fromEnvironment({{"path", "sideways"}}));
  // Whether spin_us was given: only then does a host with more ranks than cpus keep it.
  unsetenv("RESIDENT_SPIN_US");
  CHECK(!Config::fromEnvironment().spin_us_given);
  const Config given = Config::fromEnvironment({{"spin_us", "50"}});
  CHECK(given.spin_us_given && given.spin_us == 50);
  setenv("RESIDENT_SPIN_US", "7", 1);
  const Config from_env = Config::fromEnvironment();
  CHECK(from_env.spin_us_given && from_env.spin_us == 7);
  unsetenv("RESIDENT_SPIN_US");
  std::puts("test_communicator: ok");
  return 0;
}
