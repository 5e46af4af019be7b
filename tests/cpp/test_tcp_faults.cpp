// The tcp transport against peers that misbehave, over real sockets on this host: a raw client
// that completes the handshake and then sends bad, truncated or clean endings (fatal vs lost,
// nothing written outside the segment), bad handshakes before and after set-up, a peer that
// never comes, a peer that stops reading (stall timeout, abort), and no file descriptors left
// behind.
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/transport/tcp_transport.hpp"
#include "tcp_loopback.hpp"

using namespace resident;
using namespace resident::tcp;
using namespace tcp_loopback;

namespace {

// Rank 0 accepts; the test is rank 1 on a raw socket. Returns the transport and the socket.
struct Impostor {
  Impostor() : seg(8192) {
    TcpOptions opts;
    opts.handshake_timeout_ns = kSec / 2;
    t.reset(new TcpTransport(0, 2, seg.data(), seg.size, opts));
    secret = Secret::random();
    std::thread a([&] { t->establish({t->endpoint(), "-"}, {false, true}, secret, 10 * kSec); });
    raw.reset(new Raw(t->endpoint()));
    const Hello h = helloFor(secret, 1, 2);
    raw->send(&h, sizeof(h));
    a.join();
    CHECK(raw->readAck(0));
    CHECK(t->connected(1));
  }
  TcpTransport::Event event() {
    CHECK(pollUntil(*t, [&] { return t->hasEvents(); }));
    auto ev = t->takeEvents();
    CHECK(ev.size() == 1 && ev[0].peer == 1);
    CHECK(!t->connected(1));
    CHECK(seg.guardsIntact());
    return ev[0];
  }
  Segment seg;
  std::unique_ptr<TcpTransport> t;
  std::unique_ptr<Raw> raw;
  Secret secret;
};

void testBadFrames() {
  {  // good frames land; then an overrunning write: fatal, nothing of it lands
    Impostor im;
    const char msg[] = "hello";
    im.raw->frame(FrameType::kWrite, 100, sizeof(msg), msg, sizeof(msg));
    im.raw->frame(FrameType::kSignal, 8, 77);
    CHECK(pollUntil(*im.t, [&] { return im.seg.flag(8) == 77; }));
    CHECK(std::memcmp(im.seg.data() + 100, msg, sizeof(msg)) == 0);
    std::vector<unsigned char> junk(4096, 0xEE);
    im.raw->frame(FrameType::kWrite, 8000, junk.size(), junk.data(), junk.size());
    const auto ev = im.event();
    CHECK(ev.fatal && ev.reason.find("rank 1") != std::string::npos &&
          ev.reason.find("malformed") != std::string::npos);
    for (size_t i = 0; i < im.seg.size; ++i) CHECK(im.seg.data()[i] != 0xEE);
    // Writes to a failed peer are dropped quietly.
    im.t->write(1, 0, msg, sizeof(msg));
    im.t->signal(1, 0, 1);
  }
  {  // an oversized write (longer than the segment)
    Impostor im;
    im.raw->frame(FrameType::kWrite, 0, 1ull << 40);
    CHECK(im.event().fatal);
  }
  {  // an unknown frame type
    Impostor im;
    im.raw->frame(static_cast<FrameType>(9), 0, 0);
    CHECK(im.event().fatal);
  }
  {  // truncated inside a payload, then the connection drops: fatal
    Impostor im;
    const char part[10] = {0};
    im.raw->frame(FrameType::kWrite, 0, 100, part, sizeof(part));
    im.raw->close();
    const auto ev = im.event();
    CHECK(ev.fatal && ev.reason.find("inside a frame") != std::string::npos);
  }
  {  // truncated inside a header
    Impostor im;
    const FrameHeader h{static_cast<uint32_t>(FrameType::kSignal), 0, 0, 1};
    im.raw->send(&h, 10);
    im.raw->close();
    CHECK(im.event().fatal);
  }
  {  // closed at a frame boundary without a goodbye: lost, not fatal
    Impostor im;
    im.raw->frame(FrameType::kSignal, 0, 5);
    im.raw->close();
    const auto ev = im.event();
    CHECK(!ev.fatal && ev.reason.find("without a goodbye") != std::string::npos);
    CHECK(im.seg.flag(0) == 5);
  }
  {  // a goodbye
    Impostor im;
    im.raw->frame(FrameType::kClose, 0, 0);
    const auto ev = im.event();
    CHECK(!ev.fatal && ev.reason.find("shut down") != std::string::npos);
  }
}

void testBadHandshakes() {
  Impostor im;  // an established group of two (rank 1 is the raw socket)
  const uint64_t before = im.t->rejectedConnections();
  std::mt19937_64 rng(9);
  std::vector<std::unique_ptr<Raw>> conns;
  auto attempt = [&](const void* p, size_t n, bool close_after) {
    conns.emplace_back(new Raw(im.t->endpoint()));
    conns.back()->send(p, n);
    if (close_after) conns.back()->close();
  };
  std::vector<unsigned char> noise(1000);
  for (auto& b : noise) b = static_cast<unsigned char>(rng());
  attempt(noise.data(), noise.size(), false);  // random bytes
  attempt("RS", 2, true);                      // short, then closed
  Hello h = helloFor(Secret::random(), 1, 2);  // wrong secret
  attempt(&h, sizeof(h), false);
  h = helloFor(im.secret, 1, 3);  // wrong group size
  attempt(&h, sizeof(h), false);
  h = helloFor(im.secret, 7, 2);  // rank out of range
  attempt(&h, sizeof(h), false);
  h = helloFor(im.secret, 0, 2);  // our own rank
  attempt(&h, sizeof(h), false);
  h = helloFor(im.secret, 1, 2);  // a duplicate of rank 1
  attempt(&h, sizeof(h), false);
  const FrameHeader f{static_cast<uint32_t>(FrameType::kWrite), 0, 0, 1ull << 40};
  attempt(&f, sizeof(f), false);  // a frame before any hello
  attempt(&h, 20, false);         // idle half a hello (timeout)
  const uint64_t expected = before + 9;
  CHECK(pollUntil(
      *im.t, [&] { return im.t->rejectedConnections() >= expected; }, 5));
  // The real peer is unaffected.
  im.raw->frame(FrameType::kSignal, 16, 99);
  CHECK(pollUntil(*im.t, [&] { return im.seg.flag(16) == 99; }));
  CHECK(im.t->connected(1) && !im.t->hasEvents());
  // A flood beyond the pending limit is rejected at once, and the listener keeps working.
  conns.clear();
  for (int i = 0; i < 40; ++i) conns.emplace_back(new Raw(im.t->endpoint()));
  CHECK(pollUntil(
      *im.t, [&] { return im.t->rejectedConnections() >= expected + 24; }, 5));
  conns.clear();
  CHECK(im.seg.guardsIntact());
}

void testBadHandshakeDuringSetup() {
  // Junk arrives at the listener before the real peer: set-up still completes.
  Segment s0(4096), s1(4096);
  TcpTransport t0(0, 2, s0.data(), s0.size, TcpOptions{});
  TcpTransport t1(1, 2, s1.data(), s1.size, TcpOptions{});
  Raw junk(t0.endpoint());
  junk.send("GET / HTTP/1.0\r\n\r\n", 18);
  const Secret s = Secret::random();
  const std::vector<std::string> eps = {t0.endpoint(), t1.endpoint()};
  std::thread a([&] { t0.establish(eps, {false, true}, s, 10 * kSec); });
  t1.establish(eps, {true, false}, s, 10 * kSec);
  a.join();
  CHECK(pollUntil(t0, [&] { return t0.rejectedConnections() == 1; }));
  CHECK(t0.connected(1) && t1.connected(0));
  // A peer that never comes: set-up fails naming it, within the timeout.
  Segment s2(4096);
  TcpTransport lonely(0, 3, s2.data(), s2.size, TcpOptions{});
  const uint64_t t = nowNs();
  std::string err;
  try {
    lonely.establish({lonely.endpoint(), "-", "-"}, {false, true, true}, s, kSec / 2);
  } catch (const CommError& e) {
    err = e.what();
  }
  CHECK(err.find("rank 1") != std::string::npos && err.find("rank 2") != std::string::npos);
  CHECK(nowNs() - t < 3 * kSec);
}

void testStallAndAbort() {
  TcpOptions opts;
  opts.out_buffer_bytes = 4096;
  opts.stall_timeout_ns = kSec / 2;
  // A peer that stops reading (small receive buffer, never reads): write gives up after the
  // stall timeout and reports it as fatal.
  Segment seg(1 << 20);
  TcpTransport t(0, 2, seg.data(), seg.size, opts);
  const Secret s = Secret::random();
  std::thread a([&] { t.establish({t.endpoint(), "-"}, {false, true}, s, 10 * kSec); });
  Raw raw(t.endpoint(), 4096);
  const Hello h = helloFor(s, 1, 2);
  raw.send(&h, sizeof(h));
  a.join();
  CHECK(raw.readAck(0));
  std::vector<unsigned char> chunk(1 << 20, 1);
  const uint64_t start = nowNs();
  for (int i = 0; i < 256 && t.connected(1); ++i) t.write(1, 0, chunk.data(), chunk.size());
  CHECK(!t.connected(1));
  CHECK(nowNs() - start < 10 * kSec);
  auto ev = t.takeEvents();
  CHECK(ev.size() == 1 && ev[0].fatal && ev[0].reason.find("took no data") != std::string::npos);

  // abort() from another thread ends a wait for room at once.
  TcpOptions slow = opts;
  slow.stall_timeout_ns = 60 * kSec;
  Segment seg2(1 << 20);
  TcpTransport t2(0, 2, seg2.data(), seg2.size, slow);
  std::thread b([&] { t2.establish({t2.endpoint(), "-"}, {false, true}, s, 10 * kSec); });
  Raw raw2(t2.endpoint(), 4096);
  raw2.send(&h, sizeof(h));
  b.join();
  CHECK(raw2.readAck(0));
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (int i = 0; i < 256 && t2.connected(1); ++i) t2.write(1, 0, chunk.data(), chunk.size());
    done.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(!done.load());  // stuck waiting for the peer
  const uint64_t ab = nowNs();
  t2.abort();
  writer.join();
  CHECK(nowNs() - ab < 2 * kSec);
  CHECK(!t2.connected(1));
}

}  // namespace

int main() {
  const int fds = fdCount();
  testBadFrames();
  std::puts("test_tcp_faults: bad frames ok");
  testBadHandshakes();
  testBadHandshakeDuringSetup();
  std::puts("test_tcp_faults: bad handshakes ok");
  testStallAndAbort();
  std::puts("test_tcp_faults: stall and abort ok");
  const int after = fdCount();
  if (after != fds) std::fprintf(stderr, "fds: %d before, %d after\n", fds, after);
  CHECK(after == fds);
  std::puts("test_tcp_faults: ok");
  return 0;
}
