// Whether a process of this host (same pid namespace) has exited, read from /proc: a zombie
// that nobody reaped yet counts as exited (kill(pid, 0) still succeeds on one).
#pragma once

namespace resident {

bool processHasExited(int pid);

}  // namespace resident
