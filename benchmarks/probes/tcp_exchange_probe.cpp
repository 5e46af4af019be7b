// tcp_exchange_probe.cpp: the exchange a 2-rank all_reduce over tcp makes, with no GPU and no
// library: two processes on loopback, each sends its message, takes in the peer's (both
// non-blocking, busy-polled, interleaved), then spins for a stand-in of the GPU stage (the
// time the proxy trace measures from a read to the next op's trigger) before the next
// exchange. Its period is what the loopback stand-in allows an op of that pattern, to hold the
// library's op time to beside the composed floor (one-way ping-pong + GPU flag), which assumes
// the two directions cost no more than one. Variants: no stage (the exchange alone), the
// stage, the stage with the second rank sending half a stage late (ranks run out of phase), a
// socket per direction, and a sending thread on its own core beside a socket per direction (a
// send that does not hold up the receive; in phase and out of phase). Every message carries its
// exchange number, checked by the receiver (exit status 1 on a wrong one). CPU only:
// g++ -O2 -std=c++17 -pthread -o /tmp/tcp_exchange_probe benchmarks/probes/tcp_exchange_probe.cpp
//
//   usage: tcp_exchange_probe [ITERS] [CPU_A CPU_B] [--corrupt]   (default 20000; the last two
//          CPUs, where the library pins the proxies of two ranks; --corrupt: the second rank
//          sends one wrong number, which the first must notice: its test)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

namespace {

uint64_t nowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<uint64_t>(t.tv_sec) * 1000000000ull + static_cast<uint64_t>(t.tv_nsec);
}

void spinNs(uint64_t d) {
  for (const uint64_t end = nowNs() + d; nowNs() < end;) {
  }
}

[[noreturn]] void die(const char* what) {
  std::printf("{\"error\": \"%s: %s\"}\n", what, std::strerror(errno));
  std::exit(2);
}

// A connected loopback pair (TCP_NODELAY, as the library's connections).
void connectedPair(int& a, int& b) {
  const int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in s{};
  s.sin_family = AF_INET;
  s.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(s);
  if (ls < 0 || bind(ls, reinterpret_cast<sockaddr*>(&s), sizeof(s)) != 0 || listen(ls, 4) != 0 ||
      getsockname(ls, reinterpret_cast<sockaddr*>(&s), &len) != 0)
    die("listen");
  a = socket(AF_INET, SOCK_STREAM, 0);
  if (a < 0 || connect(a, reinterpret_cast<sockaddr*>(&s), sizeof(s)) != 0) die("connect");
  b = accept(ls, nullptr, nullptr);
  if (b < 0) die("accept");
  const int one = 1;
  setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(b, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  close(ls);
}

struct Variant {
  const char* name;
  bool socket_per_direction;
  bool sending_thread;  // a second thread sends while the first receives
  double stage_us;      // the GPU-stage stand-in after each exchange
  double stagger_us;    // the second rank sends this much later
};

struct Shared {  // between the two processes (mapped before the fork)
  volatile int failed;
};

void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  sched_setaffinity(0, sizeof(s), &s);  // best effort: unpinned where the CPU is not allowed
}

// One side's exchanges: send `bytes` numbered `i`, take in the peer's, check its number.
// Returns the wall time of the timed exchanges (ns), 0 on a wrong message.
uint64_t exchanges(int send_fd, int recv_fd, size_t bytes, const Variant& v, bool second,
                   int warmup, int iters, bool corrupt, int sender_cpu) {
  std::vector<unsigned char> out(bytes), in(bytes);
  // The sending thread (v.sending_thread): sends exchange i's message once `go` passes i, then
  // raises `done` to i + 1; the first thread meanwhile receives.
  std::atomic<int> go{0}, done{0};
  std::atomic<bool> stop{false};
  std::thread sender;
  if (v.sending_thread) {
    sender = std::thread([&, total = warmup + iters] {
      pin(sender_cpu);
      for (int i = 0; i < total; ++i) {
        while (go.load(std::memory_order_acquire) <= i)
          if (stop.load(std::memory_order_relaxed)) return;
        for (size_t sent = 0; sent < bytes && !stop.load(std::memory_order_relaxed);) {
          const ssize_t k = send(send_fd, out.data() + sent, bytes - sent, MSG_DONTWAIT);
          if (k > 0)
            sent += static_cast<size_t>(k);
          else if (k < 0 && errno != EAGAIN && errno != EINTR)
            die("send");
        }
        done.store(i + 1, std::memory_order_release);
      }
    });
  }
  uint64_t start = 0;
  bool wrong = false;
  for (int i = 0; i < warmup + iters; ++i) {
    if (i == warmup) start = nowNs();
    if (second && v.stagger_us > 0) spinNs(static_cast<uint64_t>(v.stagger_us * 1000));
    const auto tag = static_cast<uint64_t>(i) + 1;
    const uint64_t sent_tag = corrupt && second && i == warmup + 5 ? tag + 1 : tag;
    std::memcpy(out.data(), &sent_tag, std::min(bytes, sizeof(sent_tag)));
    size_t sent = 0, got = 0;
    if (v.sending_thread) {
      go.store(i + 1, std::memory_order_release);
      sent = bytes;
    }
    while (sent < bytes || got < bytes) {
      if (sent < bytes) {
        const ssize_t k = send(send_fd, out.data() + sent, bytes - sent, MSG_DONTWAIT);
        if (k > 0) {
          sent += static_cast<size_t>(k);
        } else if (k < 0 && errno != EAGAIN && errno != EINTR) {
          die("send");
        }
      }
      if (got < bytes) {
        const ssize_t k = recv(recv_fd, in.data() + got, bytes - got, MSG_DONTWAIT);
        if (k > 0) {
          got += static_cast<size_t>(k);
        } else if (k == 0 || (errno != EAGAIN && errno != EINTR)) {
          die("recv");
        }
      }
    }
    while (v.sending_thread && done.load(std::memory_order_acquire) <= i) {
    }
    uint64_t seen = 0;
    std::memcpy(&seen, in.data(), std::min(bytes, sizeof(seen)));
    if (seen != tag) {
      wrong = true;
      break;
    }
    if (v.stage_us > 0) spinNs(static_cast<uint64_t>(v.stage_us * 1000));
  }
  const uint64_t ns = nowNs() - start;
  if (sender.joinable()) {
    stop.store(true);
    sender.join();
  }
  return wrong ? 0 : ns;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<const char*> args;
  bool corrupt = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--corrupt") == 0)
      corrupt = true;
    else
      args.push_back(argv[i]);
  }
  const int iters = !args.empty() ? std::max(100, std::atoi(args[0])) : 20000;
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  const int cpu_a = args.size() > 2 ? std::atoi(args[1]) : static_cast<int>(std::max(0L, cpus - 1));
  const int cpu_b = args.size() > 2 ? std::atoi(args[2]) : static_cast<int>(std::max(0L, cpus - 2));
  // The GPU stage from the proxy trace of the library's all_reduce over tcp on the H200 (the
  // last read of the peer's message -> the next op's first trigger, medians of four traces):
  // ~3.3 us at 8 B, 14.6-17.8 us at 64 KiB.
  struct Case {
    size_t bytes;
    double stage_us;
  };
  const Case cases[] = {{8, 3.0}, {65536, 15.0}};
  auto* sh = static_cast<Shared*>(
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (sh == MAP_FAILED) die("mmap");
  int status = 0;
  for (const Case& c : cases) {
    const Variant variants[] = {
        {"exchange", false, false, 0.0, 0.0},
        {"exchange+stage", false, false, c.stage_us, 0.0},
        {"exchange+stage, out of phase", false, false, c.stage_us, c.stage_us / 2},
        {"exchange+stage, socket per direction", true, false, c.stage_us, 0.0},
        {"exchange+stage, sending thread, socket per direction", true, true, c.stage_us, 0.0},
        {"exchange+stage, sending thread, out of phase", true, true, c.stage_us, c.stage_us / 2},
    };
    for (const Variant& v : variants) {
      // A sending thread spins on a core of its own, two below its process's (the library
      // leaves the last CPUs to its proxies): not where there are too few cores for four.
      if (v.sending_thread && (cpus < 4 || std::min(cpu_a, cpu_b) < 2)) {
        std::printf(
            "{\"probe\": \"tcp_exchange\", \"variant\": \"%s\", \"bytes\": %zu, "
            "\"skipped\": \"needs 4 CPUs\", \"ok\": true}\n",
            v.name, c.bytes);
        continue;
      }
      std::vector<double> periods;
      for (int rep = 0; rep < 5; ++rep) {
        int a1, b1, a2 = -1, b2 = -1;
        connectedPair(a1, b1);
        if (v.socket_per_direction) connectedPair(a2, b2);
        // One socket: A sends and receives on a1, B on b1. Per direction: A sends on a1 and
        // receives on b2; B sends on a2 and receives on b1.
        const int a_recv = v.socket_per_direction ? b2 : a1;
        const int b_send = v.socket_per_direction ? a2 : b1;
        sh->failed = 0;
        const pid_t child = fork();
        if (child < 0) die("fork");
        // Each process keeps only its own ends, so that one side's close ends the other's reads.
        if (child == 0) {
          for (int fd : {a1, b2})
            if (fd >= 0) close(fd);
          pin(cpu_b);
          if (exchanges(b_send, b1, c.bytes, v, true, iters / 10, iters, corrupt, cpu_b - 2) == 0)
            sh->failed = 1;
          _exit(0);
        }
        for (int fd : {b1, a2})
          if (fd >= 0) close(fd);
        pin(cpu_a);
        const uint64_t ns =
            exchanges(a1, a_recv, c.bytes, v, false, iters / 10, iters, corrupt, cpu_a - 2);
        // Closed first: after a wrong message the peer, still exchanging, sees the connection
        // end instead of waiting for this side's next message.
        for (int fd : {a1, b2})
          if (fd >= 0) close(fd);
        int child_status = 0;
        waitpid(child, &child_status, 0);
        if (ns == 0) {
          std::printf("{\"error\": \"%s, %zu bytes: a message with a wrong number\"}\n", v.name,
                      c.bytes);
          return 1;
        }
        if (sh->failed) status = 1;
        periods.push_back(static_cast<double>(ns) / 1000.0 / iters);
      }
      std::sort(periods.begin(), periods.end());
      std::printf(
          "{\"probe\": \"tcp_exchange\", \"variant\": \"%s\", \"bytes\": %zu, \"stage_us\": %.2f, "
          "\"stagger_us\": %.2f, \"period_us\": %.3f, \"min_us\": %.3f, \"max_us\": %.3f, "
          "\"iters\": %d, \"cpus\": [%d, %d], \"ok\": %s}\n",
          v.name, c.bytes, v.stage_us, v.stagger_us, periods[periods.size() / 2], periods.front(),
          periods.back(), iters, cpu_a, cpu_b, status == 0 ? "true" : "false");
      std::fflush(stdout);
    }
  }
  return status;
}
