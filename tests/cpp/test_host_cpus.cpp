// usableCpus (csrc/core/host_cpus.hpp): the affinity count, capped by a cgroup v2 quota rounded
// up to whole CPUs; no quota, or text that is not one, leaves the affinity count.
#include <sched.h>

#include <cstdio>

#include "check.hpp"
#include "core/host_cpus.hpp"

int main() {
  using resident::usableCpus;
  CHECK(usableCpus(16, "max 100000") == 16);
  CHECK(usableCpus(16, "") == 16);
  CHECK(usableCpus(16, "200000 100000") == 2);
  CHECK(usableCpus(16, "150000 100000") == 2);  // 1.5 CPUs: a second one is partly there
  CHECK(usableCpus(16, "50000 100000") == 1);
  CHECK(usableCpus(2, "800000 100000") == 2);  // the quota never raises the mask's count
  CHECK(usableCpus(0, "max 100000") == 1);
  CHECK(usableCpus(8, "garbage") == 8);
  CHECK(usableCpus(8, "12x 100000") == 8);
  CHECK(usableCpus(8, "-1 100000") == 8);
  CHECK(usableCpus(8, "100000 0") == 8);
  CHECK(resident::cgroupDir("0::/") == "/sys/fs/cgroup");
  CHECK(resident::cgroupDir("0::/user.slice/job-7") == "/sys/fs/cgroup/user.slice/job-7");
  CHECK(resident::cgroupDir("12:cpu,cpuacct:/docker/abc") == "/sys/fs/cgroup");  // cgroup v1
  CHECK(resident::cgroupDir("") == "/sys/fs/cgroup");
  // This process: at least one CPU, and no more than its affinity mask holds.
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  CHECK(sched_getaffinity(0, sizeof(allowed), &allowed) == 0);
  const int n = usableCpus();
  CHECK(n >= 1 && n <= CPU_COUNT(&allowed));
  std::printf("host_cpus ok\n");
  return 0;
}
