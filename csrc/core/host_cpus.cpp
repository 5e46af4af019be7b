#include "core/host_cpus.hpp"

#include <sched.h>

#include <cstdlib>

#include "core/first_line.hpp"

namespace resident {

int usableCpus(int affinity_cpus, const std::string& cpu_max) {
  int cpus = affinity_cpus > 0 ? affinity_cpus : 1;
  const size_t space = cpu_max.find(' ');
  if (space == std::string::npos || cpu_max.compare(0, space, "max") == 0) return cpus;
  char* end = nullptr;
  const long long quota = std::strtoll(cpu_max.c_str(), &end, 10);
  if (end != cpu_max.c_str() + space) return cpus;
  const long long period = std::strtoll(cpu_max.c_str() + space + 1, &end, 10);
  if (*end != '\0' || quota <= 0 || period <= 0) return cpus;
  const long long quota_cpus = (quota + period - 1) / period;
  return quota_cpus < cpus ? static_cast<int>(quota_cpus) : cpus;
}

std::string cgroupDir(const std::string& proc_self_cgroup_line) {
  const std::string root = "/sys/fs/cgroup";
  if (proc_self_cgroup_line.rfind("0::", 0) != 0) return root;
  const std::string path = proc_self_cgroup_line.substr(3);
  return path.empty() || path == "/" ? root : root + path;
}

int usableCpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  const int affinity =
      sched_getaffinity(0, sizeof(allowed), &allowed) == 0 ? CPU_COUNT(&allowed) : 1;
  // Inside a cgroup namespace the process's own cgroup is the root: its path reads "0::/".
  const std::string dir = cgroupDir(readFirstLine("/proc/self/cgroup"));
  return usableCpus(affinity, readFirstLine((dir + "/cpu.max").c_str()));
}

}  // namespace resident
