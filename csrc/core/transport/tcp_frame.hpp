// The wire format of the tcp transport, kept free of sockets so that it is unit-tested on its
// own: the frames one rank sends another over its connection, the handshake that opens a
// connection, the fixed-capacity outgoing byte ring, and the incremental frame reader that
// applies frames to the local segment.
//
// A connection carries a stream of frames, each a 24-byte header, WRITE frames followed by
// their payload:
//   WRITE  {offset, length}  + length bytes: plain bytes into the receiver's segment
//   SIGNAL {offset, value}                : release-store of an 8-byte flag there
//   CLOSE  {0, 0}                         : the sender shuts down; nothing follows
// Frames are applied strictly in stream order, so a SIGNAL becomes visible after every WRITE
// sent before it on the same connection (the shm transport's guarantee). Every header is
// validated against the segment before a single byte lands: nothing is written outside it.
// Integers are in host byte order; the handshake's magic catches a peer of the other order.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace resident {
namespace tcp {

enum class FrameType : uint32_t { kWrite = 1, kSignal = 2, kClose = 3 };

struct FrameHeader {
  uint32_t type;      // FrameType
  uint32_t reserved;  // zero
  uint64_t offset;    // into the receiver's segment
  uint64_t value;     // kWrite: payload bytes; kSignal: the flag's value; kClose: zero
};
static_assert(sizeof(FrameHeader) == 24, "frame header is 24 bytes");

// nullptr when `h` may be applied to a segment of `segment_bytes` bytes; otherwise why not.
const char* validateFrame(const FrameHeader& h, size_t segment_bytes);

// The group secret: 128 random bits made by rank 0 and shared through the store.
struct Secret {
  unsigned char bytes[16] = {0};
  static Secret random();
  std::string hex() const;
  // Throws CommError when `hex` is not 32 hex digits.
  static Secret fromHex(const std::string& hex);
  bool operator==(const Secret& o) const;  // constant time
};

// Opens a connection: the connector (the higher rank) sends Hello, the acceptor checks every
// field and answers HelloAck; frames follow in both directions.
constexpr uint64_t kHelloMagic = 0x314f4c4c45485352ull;  // "RSHELLO1" as little-endian bytes
constexpr uint64_t kAckMagic = 0x3130304b43415352ull;    // "RSACK001"
struct Hello {
  uint64_t magic;
  unsigned char secret[16];
  uint32_t rank;  // the connector's rank
  uint32_t nranks;
};
static_assert(sizeof(Hello) == 32, "hello is 32 bytes");
struct HelloAck {
  uint64_t magic;
  uint32_t rank;  // the acceptor's rank
  uint32_t nranks;
};
static_assert(sizeof(HelloAck) == 16, "hello ack is 16 bytes");

// nullptr when `h` comes from a member of this group (right magic, secret, size, a rank in
// range other than `my_rank`); otherwise why not. Which ranks may connect is the caller's.
const char* validateHello(const Hello& h, const Secret& secret, int nranks, int my_rank);

// A byte ring of fixed capacity, allocated once: what is queued for one peer and not yet
// accepted by the kernel. No allocation after construction.
class OutBuffer {
 public:
  explicit OutBuffer(size_t capacity = 0) : buf_(capacity) {}
  size_t capacity() const { return buf_.size(); }
  size_t size() const { return size_; }
  size_t space() const { return buf_.size() - size_; }
  // Appends min(n, space()) bytes; returns how many.
  size_t append(const void* data, size_t n);
  // The queued bytes as at most two regions, oldest first; returns the count (0 when empty).
  int peek(iovec iov[2]) const;
  // The n queued bytes that follow the oldest `skip` ones, as at most two regions.
  int peekRange(size_t skip, size_t n, iovec iov[2]) const;
  // Drops the oldest n bytes (n <= size()).
  void consume(size_t n);
  void clear() { head_ = size_ = 0; }

 private:
  std::vector<unsigned char> buf_;
  size_t head_ = 0;  // oldest byte
  size_t size_ = 0;
};

// What is queued for one peer: bytes copied into a ring (OutBuffer), between which sit
// references to payloads that stay valid until sent (the GPU path's outbox, see
// Transport::registerSource), sent from where they are. The whole queue goes to the kernel in
// one gather (as much of it as fits in the iovecs given). No allocation after construction.
class OutQueue {
 public:
  static constexpr int kMaxRefs = 64;

  explicit OutQueue(size_t ring_capacity = 0) : ring_(ring_capacity) {}
  size_t size() const { return ring_.size() + ref_bytes_; }
  size_t space() const { return ring_.space(); }
  size_t capacity() const { return ring_.capacity(); }
  bool hasRefs() const { return nrefs_ != 0; }
  // Copies min(n, space()) bytes behind what is queued; returns how many.
  size_t append(const void* data, size_t n) {
    const size_t k = ring_.append(data, n);
    ring_in_ += k;
    return k;
  }
  // Queues [data, data + n) by reference behind what is queued; false when the table of
  // references is full (the caller copies instead).
  bool appendRef(const void* data, size_t n);
  // The queue's oldest bytes, in order, as at most `max` (>= 3) regions; returns the count.
  int gather(iovec* iov, int max) const;
  // Drops the oldest n bytes (n <= size()).
  void consume(size_t n);
  void clear();

 private:
  struct Ref {
    uint64_t at;  // ring bytes appended before it
    const unsigned char* data;
    size_t bytes;
  };
  OutBuffer ring_;
  uint64_t ring_in_ = 0;  // ring bytes ever appended
  Ref refs_[kMaxRefs] = {};
  int first_ = 0, nrefs_ = 0;  // a circular table
  size_t first_sent_ = 0;      // bytes of the oldest reference already sent
  size_t ref_bytes_ = 0;       // unsent bytes of the references
};

// Applies an incoming frame stream to a segment, in pieces of any size.
class FrameReader {
 public:
  enum class Status { kOk, kError, kClosed };

  FrameReader() = default;
  FrameReader(unsigned char* segment, size_t segment_bytes)
      : segment_(segment), segment_bytes_(segment_bytes) {}

  // Consumes all `n` bytes (returning kOk), or stops at the first invalid header (kError:
  // nothing of that frame was applied) or after a CLOSE frame (kClosed).
  Status consume(const unsigned char* data, size_t n);
  // Inside a WRITE payload: the validated destination of the next payload bytes, and how
  // many remain, so that the socket can be read straight into the segment.
  bool inPayload() const { return state_ == State::kPayload; }
  unsigned char* payloadDest() const { return dest_; }
  size_t payloadRemaining() const { return static_cast<size_t>(remaining_); }
  void payloadReceived(size_t n);
  // Between two frames (a connection ending here ended cleanly).
  bool atBoundary() const { return state_ == State::kHeader && have_ == 0; }
  bool closed() const { return state_ == State::kClosed; }
  const std::string& error() const { return error_; }
  uint64_t frames() const { return frames_; }

 private:
  enum class State { kHeader, kPayload, kClosed, kFailed };
  bool applyHeader();

  unsigned char* segment_ = nullptr;
  size_t segment_bytes_ = 0;
  State state_ = State::kHeader;
  unsigned char header_[sizeof(FrameHeader)] = {0};
  size_t have_ = 0;  // header bytes collected
  unsigned char* dest_ = nullptr;
  uint64_t remaining_ = 0;
  uint64_t frames_ = 0;
  std::string error_;
};

}  // namespace tcp
}  // namespace resident
