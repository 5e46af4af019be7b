// The tcp transport's data path over real sockets on this host: set-up between two transports,
// ordering of writes before a signal (one call for a slot's payload, header and flag included),
// writes by reference from a registered source, three ranks whose tcp peers are read through
// epoll (two peers) and directly (one), two sides sending to each other with tiny buffers and
// nobody polling (no deadlock), and no file descriptors left behind. Misbehaving peers are
// test_tcp_faults.cpp's.
#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/clock.hpp"
#include "core/transport/tcp_transport.hpp"
#include "tcp_loopback.hpp"

using namespace resident;
using namespace resident::tcp;
using namespace tcp_loopback;

namespace {

// Two transports (ranks 0 and 1 of 2) connected to each other.
struct Pair {
  Pair(size_t seg_bytes, const TcpOptions& opts) : seg0(seg_bytes), seg1(seg_bytes) {
    t0.reset(new TcpTransport(0, 2, seg0.data(), seg_bytes, opts));
    t1.reset(new TcpTransport(1, 2, seg1.data(), seg_bytes, opts));
    const std::vector<std::string> eps = {t0->endpoint(), t1->endpoint()};
    const Secret s = Secret::random();
    std::thread a([&] { t0->establish(eps, {false, true}, s, 10 * kSec); });
    t1->establish(eps, {true, false}, s, 10 * kSec);
    a.join();
    CHECK(t0->connected(1) && t1->connected(0));
  }
  Segment seg0, seg1;
  std::unique_ptr<TcpTransport> t0, t1;
};

// Polls rank 0's side until rank 1 sees flag `round` at offset 0, then checks what the round
// wrote before it: its length at offset 64, its n bytes at offset 4096.
void expectRound(Pair& p, uint64_t round, const unsigned char* want, size_t n) {
  const uint64_t end = nowNs() + 5 * kSec;
  while (p.seg1.flag(0) != round && nowNs() < end) p.t0->poll();
  CHECK(p.seg1.flag(0) == round);
  uint64_t got_n = 0;
  std::memcpy(&got_n, p.seg1.data() + 64, sizeof(got_n));
  CHECK(got_n == n);
  CHECK(std::memcmp(p.seg1.data() + 4096, want, n) == 0);
}

void testOrdering() {
  Pair p(1 << 20, TcpOptions{});
  std::mt19937_64 rng(5);
  std::atomic<bool> stop{false};
  std::thread receiver([&] {
    while (!stop.load()) p.t1->poll();
  });
  // Each round: random writes, then a flag; when the flag is seen, the writes must be there.
  std::vector<unsigned char> data(300000);
  for (uint64_t round = 1; round <= 200; ++round) {
    const size_t n = 1 + rng() % data.size();
    for (size_t i = 0; i < n; ++i) data[i] = static_cast<unsigned char>(round * 31 + i);
    p.t0->write(1, 4096, data.data(), n);
    p.t0->write(1, 64, &n, sizeof(n));
    p.t0->signal(1, 0, round);
    p.t0->poll();  // flushes
    expectRound(p, round, data.data(), n);
  }
  stop.store(true);
  receiver.join();
  CHECK(!p.t0->hasEvents() && !p.t1->hasEvents());
  CHECK(p.seg0.guardsIntact() && p.seg1.guardsIntact());
}

// writeThenSignal (a CPU tensor's slot: payload, header, flag): small and large payloads, with
// small writes queued before them, arrive whole and before their flag, and the caller may
// rewrite its buffers as soon as the call returns. Then both sides send 256 KiB payloads to
// each other that way, with 4 KiB queues and nobody polling: the kernel takes part of a call's
// bytes, the rest is queued behind what it took, and neither side deadlocks.
void testWriteThenSignal() {
  {
    Pair p(1 << 20, TcpOptions{});
    std::mt19937_64 rng(17);
    std::atomic<bool> stop{false};
    std::thread receiver([&] {
      while (!stop.load()) p.t1->poll();
    });
    std::vector<unsigned char> data(200000);
    std::vector<unsigned char> want(data.size());
    for (uint64_t round = 1; round <= 300; ++round) {
      const size_t n = rng() % 2 ? 1 + rng() % 16384 : 16384 + rng() % (data.size() - 16384);
      for (size_t i = 0; i < n; ++i) data[i] = static_cast<unsigned char>(rng());
      std::memcpy(want.data(), data.data(), n);
      const uint64_t small = round * 7;
      if (rng() % 2) p.t0->write(1, 128, &small, sizeof(small));  // queued before the slot
      uint64_t header = n;
      const WriteRegion regions[2] = {{4096, data.data(), n}, {64, &header, sizeof(header)}};
      p.t0->writeThenSignal(1, regions, 2, 0, round);
      std::memset(data.data(), 0xEE, n);  // the sources are free again
      header = 0;
      expectRound(p, round, want.data(), n);
    }
    stop.store(true);
    receiver.join();
    CHECK(!p.t0->hasEvents() && !p.t1->hasEvents());
    CHECK(p.seg0.guardsIntact() && p.seg1.guardsIntact());
  }
  TcpOptions opts;
  opts.out_buffer_bytes = 4096;
  opts.stall_timeout_ns = 20 * kSec;
  Pair p(2 << 20, opts);
  constexpr size_t kTag = 1 << 20, kFlag = kTag + 64;  // behind the payloads' three places
  std::atomic<int> finished{0};
  auto side = [&](TcpTransport& t, int peer, unsigned seed) {
    std::vector<unsigned char> chunk(256 * 1024);
    for (int i = 0; i < 128; ++i) {
      for (size_t k = 0; k < chunk.size(); k += 4096)
        chunk[k] = static_cast<unsigned char>(seed + i);
      const uint32_t tag = static_cast<uint32_t>(seed + i);
      const WriteRegion regions[2] = {{(i % 3) * chunk.size(), chunk.data(), chunk.size()},
                                      {kTag, &tag, sizeof(tag)}};
      t.writeThenSignal(peer, regions, 2, kFlag, static_cast<uint64_t>(i + 1));
      std::memset(chunk.data(), 0, chunk.size());
    }
    finished.fetch_add(1);
    while (finished.load() < 2) t.poll();
  };
  std::thread a([&] { side(*p.t0, 1, 10); });
  side(*p.t1, 0, 20);
  a.join();
  CHECK(pollUntil(*p.t0, [&] {
    p.t1->poll();
    return p.seg0.flag(kFlag) == 128 && p.seg1.flag(kFlag) == 128;
  }));
  for (int r = 0; r < 2; ++r) {
    Segment& seg = r == 0 ? p.seg1 : p.seg0;
    const unsigned seed = r == 0 ? 10 : 20;
    uint32_t tag = 0;
    std::memcpy(&tag, seg.data() + kTag, sizeof(tag));
    CHECK(tag == seed + 127);
    for (int i = 125; i < 128; ++i)  // the last payload written to each third
      for (size_t k = 0; k < 256 * 1024; k += 4096)
        CHECK(seg.data()[(i % 3) * 256 * 1024 + k] == static_cast<unsigned char>(seed + i));
  }
  CHECK(!p.t0->hasEvents() && !p.t1->hasEvents());
  CHECK(p.seg0.guardsIntact() && p.seg1.guardsIntact());
}

// Writes from the registered source (the GPU path's outbox) go by reference: mixed with copied
// writes and signals, each round arrives whole and in order; more references than one queue
// holds fall back to copies; the source is rewritten only after the peer saw the round, as the
// GPU path does. releaseSource sends what is still queued from it before it returns: the
// source overwritten right after changes nothing on the wire.
void testRegisteredSource() {
  Pair p(1 << 20, TcpOptions{});
  std::vector<unsigned char> source(256 * 1024);
  CHECK(p.t0->registerSource(source.data(), source.size()));
  std::mt19937_64 rng(11);
  std::atomic<bool> stop{false};
  std::thread receiver([&] {
    while (!stop.load()) p.t1->poll();
  });
  std::vector<unsigned char> plain(2000);
  for (uint64_t round = 1; round <= 100; ++round) {
    for (auto& b : source) b = static_cast<unsigned char>(rng());
    for (auto& b : plain) b = static_cast<unsigned char>(rng());
    // Up to 100 pieces of the source (some below the reference threshold), then a copy.
    const size_t pieces = 1 + rng() % 100;
    const size_t piece = source.size() / pieces;
    std::vector<size_t> lens(pieces);
    for (size_t i = 0; i < pieces; ++i) {
      lens[i] = 1 + rng() % piece;
      p.t0->write(1, 8192 + i * piece, source.data() + i * piece, lens[i]);
    }
    p.t0->write(1, 4096, plain.data(), plain.size());
    p.t0->signal(1, 0, round);
    const uint64_t end = nowNs() + 5 * kSec;
    while (p.seg1.flag(0) != round && nowNs() < end) p.t0->poll();
    CHECK(p.seg1.flag(0) == round);
    CHECK(std::memcmp(p.seg1.data() + 4096, plain.data(), plain.size()) == 0);
    for (size_t i = 0; i < pieces; ++i)
      CHECK(std::memcmp(p.seg1.data() + 8192 + i * piece, source.data() + i * piece, lens[i]) == 0);
  }
  // What was queued from the source leaves before releaseSource returns.
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<unsigned char>(i * 7);
  const std::vector<unsigned char> sent(source.begin(), source.begin() + 65536);
  p.t0->write(1, 8192, source.data(), 65536);
  p.t0->releaseSource();
  std::memset(source.data(), 0xEE, source.size());
  p.t0->signal(1, 0, 1000);
  const uint64_t end = nowNs() + 5 * kSec;
  while (p.seg1.flag(0) != 1000 && nowNs() < end) p.t0->poll();
  CHECK(p.seg1.flag(0) == 1000);
  CHECK(std::memcmp(p.seg1.data() + 8192, sent.data(), sent.size()) == 0);
  stop.store(true);
  receiver.join();
  CHECK(!p.t0->hasEvents() && !p.t1->hasEvents());
  CHECK(p.seg0.guardsIntact() && p.seg1.guardsIntact());
}

void testNoDeadlock() {
  // Both sides send 64 MiB to each other with 4 KiB buffers and do not call poll() while
  // doing so: only write()'s own reading while it waits for room lets them finish.
  TcpOptions opts;
  opts.out_buffer_bytes = 4096;
  opts.stall_timeout_ns = 20 * kSec;
  Pair p(1 << 20, opts);
  auto run = [](TcpTransport& t, int peer, unsigned seed) {
    std::vector<unsigned char> chunk(256 * 1024);
    for (int i = 0; i < 256; ++i) {
      for (size_t k = 0; k < chunk.size(); k += 4096)
        chunk[k] = static_cast<unsigned char>(seed + i);
      t.write(peer, (i % 3) * chunk.size(), chunk.data(), chunk.size());
      t.write(peer, 999, &i, 1);  // small, unaligned, queued behind the large one
      t.signal(peer, 1 << 19, static_cast<uint64_t>(i + 1));
    }
  };
  // A side that is done keeps polling (as its proxy would) until the other is done too.
  std::atomic<int> finished{0};
  auto side = [&](TcpTransport& t, int peer, unsigned seed) {
    run(t, peer, seed);
    finished.fetch_add(1);
    while (finished.load() < 2) t.poll();
  };
  std::thread a([&] { side(*p.t0, 1, 10); });
  side(*p.t1, 0, 20);
  a.join();
  // Both poll: what is still queued on one side goes out while the other takes it in.
  CHECK(pollUntil(*p.t0, [&] {
    p.t1->poll();
    return p.seg0.flag(1 << 19) == 256 && p.seg1.flag(1 << 19) == 256;
  }));
  CHECK(p.seg1.data()[(255 % 3) * 256 * 1024] == static_cast<unsigned char>(10 + 255));
  CHECK(p.seg0.data()[(255 % 3) * 256 * 1024] == static_cast<unsigned char>(20 + 255));
  CHECK(!p.t0->hasEvents() && !p.t1->hasEvents());
  CHECK(p.seg0.guardsIntact() && p.seg1.guardsIntact());
}

// Three ranks: rank 0 has two tcp peers (read through epoll), ranks 1 and 2 one each (their
// socket read directly). Rounds of random writes then a flag in both directions arrive whole
// and in order on both kinds of reading; strangers are turned away by either kind's listener;
// a peer's goodbye reaches rank 0 while its other peer stays connected.
void testMixedPeerCounts() {
  constexpr size_t kSeg = 1 << 20;
  Segment s0(kSeg), s1(kSeg), s2(kSeg);
  TcpTransport t0(0, 3, s0.data(), kSeg, TcpOptions{});
  TcpTransport t1(1, 3, s1.data(), kSeg, TcpOptions{});
  TcpTransport t2(2, 3, s2.data(), kSeg, TcpOptions{});
  const std::vector<std::string> eps = {t0.endpoint(), t1.endpoint(), t2.endpoint()};
  const Secret s = Secret::random();
  std::thread a([&] { t1.establish(eps, {true, false, false}, s, 10 * kSec); });
  std::thread b([&] { t2.establish(eps, {true, false, false}, s, 10 * kSec); });
  t0.establish(eps, {false, true, true}, s, 10 * kSec);
  a.join();
  b.join();
  CHECK(t0.connected(1) && t0.connected(2) && t1.connected(0) && t2.connected(0));
  auto pollAll = [&] {
    t0.poll();
    t1.poll();
    t2.poll();
  };
  std::mt19937_64 rng(13);
  std::vector<unsigned char> d1(70000), d2(70000), d0(70000);
  for (uint64_t round = 1; round <= 100; ++round) {
    const size_t n1 = 1 + rng() % d1.size(), n2 = 1 + rng() % d2.size();
    const size_t n0 = 1 + rng() % d0.size();
    for (size_t i = 0; i < d1.size(); ++i) {
      d1[i] = static_cast<unsigned char>(rng());
      d2[i] = static_cast<unsigned char>(rng());
      d0[i] = static_cast<unsigned char>(rng());
    }
    // Ranks 1 and 2 into disjoint regions of rank 0; rank 0 into each of them.
    t1.write(0, 4096, d1.data(), n1);
    t1.signal(0, 0, round);
    t2.write(0, 4096 + d1.size(), d2.data(), n2);
    t2.signal(0, 8, round);
    t0.write(1, 4096, d0.data(), n0);
    t0.signal(1, 0, round);
    t0.write(2, 4096, d0.data(), n0);
    t0.signal(2, 0, round);
    const uint64_t end = nowNs() + 5 * kSec;
    while ((s0.flag(0) != round || s0.flag(8) != round || s1.flag(0) != round ||
            s2.flag(0) != round) &&
           nowNs() < end)
      pollAll();
    CHECK(s0.flag(0) == round && s0.flag(8) == round && s1.flag(0) == round && s2.flag(0) == round);
    CHECK(std::memcmp(s0.data() + 4096, d1.data(), n1) == 0);
    CHECK(std::memcmp(s0.data() + 4096 + d1.size(), d2.data(), n2) == 0);
    CHECK(std::memcmp(s1.data() + 4096, d0.data(), n0) == 0);
    CHECK(std::memcmp(s2.data() + 4096, d0.data(), n0) == 0);
  }
  {  // strangers, at the listener of a rank of each kind
    Raw at0(t0.endpoint()), at1(t1.endpoint());
    const Hello h = helloFor(Secret::random(), 2, 3);
    at0.send(&h, sizeof(h));
    at1.send(&h, sizeof(h));
    CHECK(pollUntil(t0, [&] { return t0.rejectedConnections() == 1; }));
    CHECK(pollUntil(t1, [&] { return t1.rejectedConnections() == 1; }));
  }
  t2.shutdown();  // its goodbye
  CHECK(pollUntil(t0, [&] { return t0.hasEvents(); }));
  const auto ev = t0.takeEvents();
  CHECK(ev.size() == 1 && ev[0].peer == 2 && ev[0].goodbye && !ev[0].fatal);
  CHECK(t0.connected(1) && !t0.connected(2));
  t1.signal(0, 16, 7);
  t1.poll();
  CHECK(pollUntil(t0, [&] { return s0.flag(16) == 7; }));
  CHECK(!t0.hasEvents() && !t1.hasEvents());
  CHECK(s0.guardsIntact() && s1.guardsIntact() && s2.guardsIntact());
}

}  // namespace

int main() {
  const int fds = fdCount();
  testOrdering();
  std::puts("test_tcp_transport: ordering ok");
  testRegisteredSource();
  std::puts("test_tcp_transport: registered source ok");
  testWriteThenSignal();
  std::puts("test_tcp_transport: write then signal ok");
  testNoDeadlock();
  std::puts("test_tcp_transport: no deadlock ok");
  testMixedPeerCounts();
  std::puts("test_tcp_transport: one and two tcp peers ok");
  const int after = fdCount();
  if (after != fds) std::fprintf(stderr, "fds: %d before, %d after\n", fds, after);
  CHECK(after == fds);
  std::puts("test_tcp_transport: ok");
  return 0;
}
