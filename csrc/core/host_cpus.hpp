// How many CPUs this process can keep busy at once, so that the proxy can tell a host with a
// core to spare for it from one where its ranks' callers and proxies outnumber the cores.
#pragma once

#include <string>

namespace resident {

// The CPUs of the affinity mask, capped by the cgroup v2 CPU quota where one is set.
int usableCpus();

// The rule on its inputs: `affinity_cpus`, and the text of the cgroup's cpu.max ("max 100000":
// no quota; "150000 100000": 1.5 CPUs, counted as 2). Malformed text is no quota.
int usableCpus(int affinity_cpus, const std::string& cpu_max);

// The cgroup v2 directory of this process ("0::/path" in /proc/self/cgroup) under
// /sys/fs/cgroup, or /sys/fs/cgroup itself.
std::string cgroupDir(const std::string& proc_self_cgroup_line);

}  // namespace resident
