// The tcp transport's wire format without sockets: the frame validator, the incremental frame
// reader (random frame streams fed in random pieces against a reference, guard bytes around
// the segment to catch any write outside it, malformed, oversized, out-of-range and truncated
// frames), the outgoing byte ring against a reference queue, and the handshake checks.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/error.hpp"
#include "core/transport/tcp_frame.hpp"

using namespace resident;
using namespace resident::tcp;

namespace {

constexpr size_t kGuard = 256;
constexpr unsigned char kGuardByte = 0xA5;

FrameHeader header(FrameType t, uint64_t offset, uint64_t value) {
  return FrameHeader{static_cast<uint32_t>(t), 0, offset, value};
}

void put(std::vector<unsigned char>& s, const FrameHeader& h) {
  const auto* p = reinterpret_cast<const unsigned char*>(&h);
  s.insert(s.end(), p, p + sizeof(h));
}

// A segment with guard bytes on both sides.
struct Guarded {
  explicit Guarded(size_t bytes) : buf(bytes + 2 * kGuard, kGuardByte), size(bytes) {
    std::memset(seg(), 0, bytes);
  }
  unsigned char* seg() { return buf.data() + kGuard; }
  bool guardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i)
      if (buf[i] != kGuardByte || buf[kGuard + size + i] != kGuardByte) return false;
    return true;
  }
  std::vector<unsigned char> buf;
  size_t size;
};

// Feeds `stream` to `r` in random pieces, sometimes straight into the payload destination.
FrameReader::Status feed(FrameReader& r, const std::vector<unsigned char>& stream,
                         std::mt19937_64& rng) {
  size_t pos = 0;
  while (pos < stream.size()) {
    const size_t left = stream.size() - pos;
    if (r.inPayload() && rng() % 2 == 0) {
      const size_t n =
          std::min<size_t>(left, std::min<size_t>(r.payloadRemaining(), 1 + rng() % 5000));
      std::memcpy(r.payloadDest(), stream.data() + pos, n);
      r.payloadReceived(n);
      pos += n;
      continue;
    }
    const size_t n = std::min<size_t>(left, 1 + rng() % 300);
    const auto st = r.consume(stream.data() + pos, n);
    pos += n;
    if (st != FrameReader::Status::kOk) return st;
  }
  return FrameReader::Status::kOk;
}

void testValidate() {
  const size_t seg = 4096;
  CHECK(validateFrame(header(FrameType::kWrite, 0, seg), seg) == nullptr);
  CHECK(validateFrame(header(FrameType::kWrite, seg, 0), seg) == nullptr);
  CHECK(validateFrame(header(FrameType::kWrite, 4000, 96), seg) == nullptr);
  CHECK(validateFrame(header(FrameType::kWrite, 4000, 97), seg) != nullptr);       // overrun
  CHECK(validateFrame(header(FrameType::kWrite, seg + 1, 0), seg) != nullptr);     // offset out
  CHECK(validateFrame(header(FrameType::kWrite, 8, UINT64_MAX), seg) != nullptr);  // wraps
  CHECK(validateFrame(header(FrameType::kWrite, UINT64_MAX, 2), seg) != nullptr);
  CHECK(validateFrame(header(FrameType::kWrite, 0, seg + 1), seg) != nullptr);  // oversized
  CHECK(validateFrame(header(FrameType::kSignal, seg - 8, 1), seg) == nullptr);
  CHECK(validateFrame(header(FrameType::kSignal, seg - 4, 1), seg) != nullptr);
  CHECK(validateFrame(header(FrameType::kSignal, seg, 1), seg) != nullptr);
  CHECK(validateFrame(header(FrameType::kSignal, 12, 1), seg) != nullptr);  // misaligned
  CHECK(validateFrame(header(FrameType::kSignal, 0, 1), 4) != nullptr);     // tiny segment
  CHECK(validateFrame(header(FrameType::kClose, 0, 0), seg) == nullptr);
  CHECK(validateFrame(header(FrameType::kClose, 0, 1), seg) != nullptr);
  CHECK(validateFrame(FrameHeader{0, 0, 0, 0}, seg) != nullptr);  // unknown type
  CHECK(validateFrame(FrameHeader{9, 0, 0, 0}, seg) != nullptr);
  FrameHeader h = header(FrameType::kWrite, 0, 1);
  h.reserved = 1;
  CHECK(validateFrame(h, seg) != nullptr);
}

void testRandomStreams() {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    const size_t seg = 64 + (rng() % 64) * 64;
    Guarded g(seg);
    std::vector<unsigned char> ref(seg, 0), stream;
    const int frames = 1 + static_cast<int>(rng() % 40);
    for (int f = 0; f < frames; ++f) {
      if (rng() % 3 == 0) {
        const uint64_t off = (rng() % (seg / 8)) * 8;
        const uint64_t v = rng();
        put(stream, header(FrameType::kSignal, off, v));
        std::memcpy(ref.data() + off, &v, 8);
      } else {
        const uint64_t off = rng() % (seg + 1);
        const uint64_t len = rng() % (seg - off + 1);
        put(stream, header(FrameType::kWrite, off, len));
        for (uint64_t i = 0; i < len; ++i) {
          const auto b = static_cast<unsigned char>(rng());
          stream.push_back(b);
          ref[off + i] = b;
        }
      }
    }
    FrameReader r(g.seg(), seg);
    CHECK(feed(r, stream, rng) == FrameReader::Status::kOk);
    CHECK(r.atBoundary());
    CHECK(r.frames() == static_cast<uint64_t>(frames));
    CHECK(std::memcmp(g.seg(), ref.data(), seg) == 0);
    CHECK(g.guardsIntact());
  }
}

// A good prefix, then `bad`: the prefix lands, nothing of the bad frame does.
void expectRejected(const FrameHeader& bad, const char* what) {
  const size_t seg = 1024;
  Guarded g(seg);
  std::vector<unsigned char> stream;
  put(stream, header(FrameType::kWrite, 16, 4));
  for (unsigned char b : {1, 2, 3, 4}) stream.push_back(b);
  put(stream, bad);
  for (int i = 0; i < 2048; ++i) stream.push_back(0xEE);  // the "payload" an attacker sends
  std::mt19937_64 rng(11);
  FrameReader r(g.seg(), seg);
  const auto st = feed(r, stream, rng);
  if (st != FrameReader::Status::kError) {
    std::fprintf(stderr, "not rejected: %s\n", what);
    CHECK(false);
  }
  CHECK(!r.error().empty());
  CHECK(g.seg()[16] == 1 && g.seg()[19] == 4);
  for (size_t i = 0; i < seg; ++i) CHECK(g.seg()[i] != 0xEE);
  CHECK(g.guardsIntact());
  // A failed reader stays failed.
  const unsigned char more[8] = {0};
  CHECK(r.consume(more, sizeof(more)) == FrameReader::Status::kError);
}

void testMalformed() {
  expectRejected(header(FrameType::kWrite, 1000, 100), "overrun");
  expectRejected(header(FrameType::kWrite, 0, 1u << 30), "oversized");
  expectRejected(header(FrameType::kWrite, 4096, 1), "offset out of range");
  expectRejected(header(FrameType::kWrite, 8, UINT64_MAX - 4), "wrapping length");
  expectRejected(header(FrameType::kSignal, 1020, 5), "signal past the end");
  expectRejected(header(FrameType::kSignal, 3, 5), "misaligned signal");
  expectRejected(FrameHeader{77, 0, 0, 0}, "unknown type");
  FrameHeader r = header(FrameType::kWrite, 0, 1);
  r.reserved = 0xdead;
  expectRejected(r, "reserved bits");
  expectRejected(header(FrameType::kClose, 0, 9), "close with data");
}

void testTruncatedAndClose() {
  const size_t seg = 512;
  Guarded g(seg);
  std::vector<unsigned char> stream;
  put(stream, header(FrameType::kWrite, 100, 50));
  stream.resize(stream.size() + 50, 7);
  put(stream, header(FrameType::kSignal, 0, 42));
  // Cut inside the second header: not at a boundary.
  {
    FrameReader r(g.seg(), seg);
    CHECK(r.atBoundary());
    CHECK(r.consume(stream.data(), sizeof(FrameHeader) + 50 + 5) == FrameReader::Status::kOk);
    CHECK(!r.atBoundary() && !r.inPayload());
  }
  // Cut inside the payload.
  {
    FrameReader r(g.seg(), seg);
    CHECK(r.consume(stream.data(), sizeof(FrameHeader) + 10) == FrameReader::Status::kOk);
    CHECK(r.inPayload() && r.payloadRemaining() == 40 && r.payloadDest() == g.seg() + 110);
    CHECK(!r.atBoundary());
  }
  // The whole stream, then a goodbye and trailing garbage that is not applied.
  {
    FrameReader r(g.seg(), seg);
    std::vector<unsigned char> s = stream;
    put(s, header(FrameType::kClose, 0, 0));
    put(s, header(FrameType::kWrite, 0, 8));
    s.resize(s.size() + 8, 0xEE);
    CHECK(r.consume(s.data(), s.size()) == FrameReader::Status::kClosed);
    CHECK(r.closed());
    uint64_t flag = 0;
    std::memcpy(&flag, g.seg(), 8);
    CHECK(flag == 42);
    CHECK(g.seg()[100] == 7 && g.seg()[149] == 7 && g.seg()[150] == 0);
    CHECK(g.guardsIntact());
  }
}

void testOutBuffer() {
  std::mt19937_64 rng(3);
  for (size_t cap : {size_t(1), size_t(7), size_t(64), size_t(1000)}) {
    OutBuffer b(cap);
    std::deque<unsigned char> ref;
    unsigned char next = 0;
    for (int step = 0; step < 20000; ++step) {
      if (rng() % 2 == 0) {
        std::vector<unsigned char> data(rng() % (2 * cap + 2));
        for (auto& x : data) x = next++;
        const size_t took = b.append(data.data(), data.size());
        CHECK(took == std::min(data.size(), cap - ref.size()));
        ref.insert(ref.end(), data.begin(), data.begin() + static_cast<std::ptrdiff_t>(took));
      } else {
        const size_t n = ref.empty() ? 0 : rng() % (ref.size() + 1);
        b.consume(n);
        ref.erase(ref.begin(), ref.begin() + static_cast<std::ptrdiff_t>(n));
      }
      CHECK(b.size() == ref.size() && b.space() == cap - ref.size());
      iovec iov[2];
      const int k = b.peek(iov);
      CHECK((k == 0) == ref.empty());
      std::vector<unsigned char> seen;
      for (int i = 0; i < k; ++i) {
        const auto* p = static_cast<const unsigned char*>(iov[i].iov_base);
        seen.insert(seen.end(), p, p + iov[i].iov_len);
      }
      CHECK(seen.size() == ref.size() && std::equal(seen.begin(), seen.end(), ref.begin()));
    }
  }
}

// OutQueue against a model: copied bytes and referenced payloads interleaved, gathered with
// few or many iovecs and consumed by random amounts (a partial sendmsg), always in order.
void testOutQueue() {
  std::mt19937_64 rng(5);
  std::vector<unsigned char> source(1 << 16);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<unsigned char>(rng());
  for (size_t cap : {size_t(16), size_t(100), size_t(4096)}) {
    OutQueue q(cap);
    std::deque<unsigned char> ref;
    size_t ring_bytes = 0;  // copied bytes queued
    int refs = 0;           // references queued (a bound on what appendRef accepts)
    std::vector<int> ref_ends;
    for (int step = 0; step < 20000; ++step) {
      const unsigned r = static_cast<unsigned>(rng() % 4);
      if (r == 0) {
        std::vector<unsigned char> data(rng() % (cap / 2 + 2));
        for (auto& x : data) x = static_cast<unsigned char>(rng());
        const size_t took = q.append(data.data(), data.size());
        CHECK(took == std::min(data.size(), cap - ring_bytes));
        ref.insert(ref.end(), data.begin(), data.begin() + static_cast<std::ptrdiff_t>(took));
        ring_bytes += took;
      } else if (r == 1) {
        const size_t off = rng() % source.size();
        const size_t n = rng() % std::min<size_t>(source.size() - off, 3000);
        const bool ok = q.appendRef(source.data() + off, n);
        if (ok) ref.insert(ref.end(), source.begin() + off, source.begin() + off + n);
        CHECK(ok || refs == OutQueue::kMaxRefs);
      } else {
        const int max = 3 + static_cast<int>(rng() % 8);
        std::vector<iovec> iov(static_cast<size_t>(max));
        const int k = q.gather(iov.data(), max);
        CHECK(k <= max && (k == 0) == ref.empty());
        std::vector<unsigned char> seen;
        for (int i = 0; i < k; ++i) {
          const auto* p = static_cast<const unsigned char*>(iov[i].iov_base);
          seen.insert(seen.end(), p, p + iov[i].iov_len);
        }
        CHECK(seen.size() <= ref.size() && std::equal(seen.begin(), seen.end(), ref.begin()));
        CHECK(!ref.empty() == !seen.empty());
        const size_t n = seen.empty() ? 0 : rng() % (seen.size() + 1);
        q.consume(n);
        // The ring bytes among the consumed ones: those not inside a reference.
        ref.erase(ref.begin(), ref.begin() + static_cast<std::ptrdiff_t>(n));
      }
      CHECK(q.size() == ref.size());
      // Recount what the queue holds: its ring and its references (from a full gather).
      std::vector<iovec> all(3 * OutQueue::kMaxRefs + 2);
      const int k = q.gather(all.data(), static_cast<int>(all.size()));
      size_t total = 0;
      ring_bytes = 0;
      refs = 0;
      for (int i = 0; i < k; ++i) {
        total += all[static_cast<size_t>(i)].iov_len;
        const auto* p = static_cast<const unsigned char*>(all[static_cast<size_t>(i)].iov_base);
        if (p >= source.data() && p < source.data() + source.size())
          ++refs;
        else
          ring_bytes += all[static_cast<size_t>(i)].iov_len;
      }
      CHECK(total == ref.size() && q.space() == cap - ring_bytes);
    }
    q.clear();
    CHECK(q.size() == 0 && q.space() == cap);
  }
}

void testHello() {
  const Secret s = Secret::random();
  CHECK(Secret::fromHex(s.hex()) == s);
  CHECK(s.hex().size() == 32);
  CHECK(!(Secret::random() == s));
  CHECK_THROWS(Secret::fromHex("abc"));
  CHECK_THROWS(Secret::fromHex(std::string(32, 'g')));
  Hello h{};
  h.magic = kHelloMagic;
  std::memcpy(h.secret, s.bytes, sizeof(h.secret));
  h.rank = 2;
  h.nranks = 4;
  CHECK(validateHello(h, s, 4, 0) == nullptr);
  CHECK(validateHello(h, s, 4, 2) != nullptr);  // our own rank
  CHECK(validateHello(h, s, 3, 0) != nullptr);  // group size
  Hello bad = h;
  bad.magic ^= 1;
  CHECK(validateHello(bad, s, 4, 0) != nullptr);
  bad = h;
  bad.secret[15] ^= 0x80;
  CHECK(validateHello(bad, s, 4, 0) != nullptr);
  bad = h;
  bad.rank = 4;
  CHECK(validateHello(bad, s, 4, 0) != nullptr);
  bad.rank = UINT32_MAX;
  CHECK(validateHello(bad, s, 4, 0) != nullptr);
}

}  // namespace

int main() {
  testValidate();
  testRandomStreams();
  testMalformed();
  testTruncatedAndClose();
  testOutBuffer();
  testOutQueue();
  testHello();
  std::puts("test_tcp_frame: ok");
  return 0;
}
