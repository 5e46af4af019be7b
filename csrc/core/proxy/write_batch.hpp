// A proxy pass's batch of writes to peers (the CUDA path's outbox ranges), put in outbox order
// with the ranges that continue each other merged, so that a kernel's parts go out as few long
// writes. Pure logic, shared by the proxy (csrc/cuda/gpu_communicator_proxy.cpp) and its unit
// test (tests/cpp/test_write_batch.cpp).
#pragma once

#include <cstdint>

namespace resident {

struct BatchWrite {
  int peer;
  uint64_t local, remote, bytes;  // outbox offset, offset in the peer's GPU region, length
};

// True when `next` continues `last` both in the outbox and at the peer (one write can carry both).
inline bool continuesWrite(const BatchWrite& last, const BatchWrite& next) {
  return last.peer == next.peer && last.local + last.bytes == next.local &&
         last.remote + last.bytes == next.remote;
}

// Sorts batch[0, n) by (peer, local offset) and merges each write into the one before when it
// continues it both locally and remotely; returns the new count. Only for writes that are
// independent and do not overlap (the proxy's: each range is vouched for by its own line flags
// or by a flag raised after the batch, and a slot is rewritten only after the peer consumed
// it, which it cannot have done before the batch is posted). Blocks reserve their FIFO
// positions in any order, so a kernel's adjacent parts often arrive apart.
inline int sortAndMergeWrites(BatchWrite* batch, int n) {
  if (n < 2) return n;
  for (int i = 1; i < n; ++i) {  // insertion sort: a few dozen entries at most
    const BatchWrite w = batch[i];
    int k = i;
    for (; k > 0 && (batch[k - 1].peer > w.peer ||
                     (batch[k - 1].peer == w.peer && batch[k - 1].local > w.local));
         --k)
      batch[k] = batch[k - 1];
    batch[k] = w;
  }
  int m = 0;
  for (int i = 1; i < n; ++i) {
    if (continuesWrite(batch[m], batch[i]))
      batch[m].bytes += batch[i].bytes;
    else
      batch[++m] = batch[i];
  }
  return m + 1;
}

}  // namespace resident
