#include "core/transport/tcp_frame.hpp"

#include <sys/random.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/error.hpp"

namespace resident {
namespace tcp {

const char* validateFrame(const FrameHeader& h, size_t segment_bytes) {
  if (h.reserved != 0) return "reserved header field is not zero";
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kWrite:
      if (h.offset > segment_bytes) return "write offset lies outside the segment";
      if (h.value > segment_bytes - h.offset) return "write length overruns the segment";
      return nullptr;
    case FrameType::kSignal:
      if (h.offset % 8 != 0) return "signal offset is not 8-byte aligned";
      if (segment_bytes < 8 || h.offset > segment_bytes - 8)
        return "signal offset lies outside the segment";
      return nullptr;
    case FrameType::kClose:
      if (h.offset != 0 || h.value != 0) return "close frame carries data";
      return nullptr;
  }
  return "unknown frame type";
}

Secret Secret::random() {
  Secret s;
  size_t got = 0;
  while (got < sizeof(s.bytes)) {
    const ssize_t n = getrandom(s.bytes + got, sizeof(s.bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw CommError(std::string("resident: getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  return s;
}

std::string Secret::hex() const {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

Secret Secret::fromHex(const std::string& hex) {
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  Secret s;
  if (hex.size() != 2 * sizeof(s.bytes)) throw CommError("resident: malformed tcp group secret");
  for (size_t i = 0; i < sizeof(s.bytes); ++i) {
    const int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) throw CommError("resident: malformed tcp group secret");
    s.bytes[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return s;
}

bool Secret::operator==(const Secret& o) const {
  unsigned diff = 0;
  for (size_t i = 0; i < sizeof(bytes); ++i) diff |= static_cast<unsigned>(bytes[i] ^ o.bytes[i]);
  return diff == 0;
}

const char* validateHello(const Hello& h, const Secret& secret, int nranks, int my_rank) {
  if (h.magic != kHelloMagic) return "bad magic (not a resident peer)";
  Secret got;
  std::memcpy(got.bytes, h.secret, sizeof(got.bytes));
  if (!(got == secret)) return "wrong group secret";
  if (h.nranks != static_cast<uint32_t>(nranks)) return "group size does not match";
  if (h.rank >= static_cast<uint32_t>(nranks)) return "rank out of range";
  if (h.rank == static_cast<uint32_t>(my_rank)) return "claims this rank's own rank";
  return nullptr;
}

size_t OutBuffer::append(const void* data, size_t n) {
  if (n > space()) n = space();
  const auto* src = static_cast<const unsigned char*>(data);
  const size_t cap = buf_.size();
  size_t tail = head_ + size_;
  if (tail >= cap) tail -= cap;
  const size_t first = n < cap - tail ? n : cap - tail;
  if (first != 0) std::memcpy(buf_.data() + tail, src, first);
  if (n > first) std::memcpy(buf_.data(), src + first, n - first);
  size_ += n;
  return n;
}

int OutBuffer::peek(iovec iov[2]) const {
  return peekRange(0, size_, iov);
}

int OutBuffer::peekRange(size_t skip, size_t n, iovec iov[2]) const {
  if (skip >= size_ || n == 0) return 0;
  if (n > size_ - skip) n = size_ - skip;
  const size_t cap = buf_.size();
  size_t start = head_ + skip;
  if (start >= cap) start -= cap;
  const size_t first = n < cap - start ? n : cap - start;
  iov[0].iov_base = const_cast<unsigned char*>(buf_.data() + start);
  iov[0].iov_len = first;
  if (first == n) return 1;
  iov[1].iov_base = const_cast<unsigned char*>(buf_.data());
  iov[1].iov_len = n - first;
  return 2;
}

bool OutQueue::appendRef(const void* data, size_t n) {
  if (n == 0) return true;
  if (nrefs_ == kMaxRefs) return false;
  refs_[(first_ + nrefs_) % kMaxRefs] = Ref{ring_in_, static_cast<const unsigned char*>(data), n};
  ++nrefs_;
  ref_bytes_ += n;
  return true;
}

int OutQueue::gather(iovec* iov, int max) const {
  int k = 0;
  size_t skip = 0;  // ring bytes already listed
  const uint64_t ring_head = ring_in_ - ring_.size();
  int i = 0;
  for (; i < nrefs_ && k + 3 <= max; ++i) {
    const Ref& r = refs_[(first_ + i) % kMaxRefs];
    const size_t before = static_cast<size_t>(r.at - ring_head) - skip;
    k += ring_.peekRange(skip, before, iov + k);
    skip += before;
    const size_t sent = i == 0 ? first_sent_ : 0;
    iov[k].iov_base = const_cast<unsigned char*>(r.data + sent);
    iov[k].iov_len = r.bytes - sent;
    ++k;
  }
  // The ring's tail only behind the last reference (listed in order, nothing skipped).
  if (i == nrefs_ && k + 2 <= max) k += ring_.peekRange(skip, ring_.size() - skip, iov + k);
  return k;
}

void OutQueue::consume(size_t n) {
  while (n != 0) {
    const size_t ring_before =
        nrefs_ == 0 ? ring_.size()
                    : static_cast<size_t>(refs_[first_].at - (ring_in_ - ring_.size()));
    if (ring_before != 0) {
      const size_t k = n < ring_before ? n : ring_before;
      ring_.consume(k);
      n -= k;
      continue;
    }
    if (nrefs_ == 0) return;  // n > size(): nothing left
    const Ref& r = refs_[first_];
    const size_t left = r.bytes - first_sent_;
    const size_t k = n < left ? n : left;
    first_sent_ += k;
    ref_bytes_ -= k;
    n -= k;
    if (first_sent_ == r.bytes) {
      first_ = (first_ + 1) % kMaxRefs;
      --nrefs_;
      first_sent_ = 0;
    }
  }
}

void OutQueue::clear() {
  ring_.clear();
  ring_in_ = 0;
  first_ = nrefs_ = 0;
  first_sent_ = ref_bytes_ = 0;
}

void OutBuffer::consume(size_t n) {
  if (n > size_) n = size_;
  size_ -= n;
  head_ = size_ == 0 ? 0 : (head_ + n) % buf_.size();
}

bool FrameReader::applyHeader() {
  FrameHeader h;
  std::memcpy(&h, header_, sizeof(h));
  have_ = 0;
  if (const char* why = validateFrame(h, segment_bytes_)) {
    error_ = std::string(why) + " (type " + std::to_string(h.type) + ", offset " +
             std::to_string(h.offset) + ", value " + std::to_string(h.value) + ", segment " +
             std::to_string(segment_bytes_) + " bytes)";
    state_ = State::kFailed;
    return false;
  }
  ++frames_;
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kWrite:
      dest_ = segment_ + h.offset;
      remaining_ = h.value;
      state_ = remaining_ == 0 ? State::kHeader : State::kPayload;
      break;
    case FrameType::kSignal:
      // Every earlier frame of this connection was applied by this thread before: the
      // release store publishes them with the flag.
      reinterpret_cast<std::atomic<uint64_t>*>(segment_ + h.offset)
          ->store(h.value, std::memory_order_release);
      break;
    case FrameType::kClose:
      state_ = State::kClosed;
      break;
  }
  return true;
}

FrameReader::Status FrameReader::consume(const unsigned char* data, size_t n) {
  while (n > 0) {
    switch (state_) {
      case State::kHeader: {
        const size_t take = n < sizeof(header_) - have_ ? n : sizeof(header_) - have_;
        std::memcpy(header_ + have_, data, take);
        have_ += take;
        data += take;
        n -= take;
        if (have_ == sizeof(header_) && !applyHeader()) return Status::kError;
        if (state_ == State::kClosed) return Status::kClosed;
        break;
      }
      case State::kPayload: {
        const size_t take = n < remaining_ ? n : static_cast<size_t>(remaining_);
        std::memcpy(dest_, data, take);
        payloadReceived(take);
        data += take;
        n -= take;
        break;
      }
      case State::kClosed:
        return Status::kClosed;
      case State::kFailed:
        return Status::kError;
    }
  }
  if (state_ == State::kFailed) return Status::kError;
  return state_ == State::kClosed ? Status::kClosed : Status::kOk;
}

void FrameReader::payloadReceived(size_t n) {
  dest_ += n;
  remaining_ -= n;
  if (remaining_ == 0) state_ = State::kHeader;
}

}  // namespace tcp
}  // namespace resident
