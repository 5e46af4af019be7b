// The communicator's ib set-up: one IbTransport for the peers whose transport is "ib" (both
// ends have an active RDMA port), its queue pairs connected through the c10d store. Runs once,
// at group creation; a failure fails the group's creation with the reason.
#include "core/communicator.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/transport/ib/ib_transport.hpp"

namespace resident {

void Communicator::connectIb(BootstrapStore& store) {
  std::vector<bool> remote(static_cast<size_t>(nranks_), false);
  bool any = false;
  for (int p = 0; p < nranks_; ++p) {
    remote[static_cast<size_t>(p)] = kinds_[static_cast<size_t>(p)] == "ib";
    any = any || remote[static_cast<size_t>(p)];
  }
  if (!any) return;
  std::string why;
  ib_ = ib::IbTransport::create(ib::IbOptions{}, rank_, nranks_, remote, inbox_.data(),
                                inbox_.size(), &why);
  if (!ib_) throw CommError("resident: the ib transport could not be set up: " + why);
  const auto key = [](int from, int to) {
    return "resident/ib/" + std::to_string(from) + "/" + std::to_string(to);
  };
  for (int p = 0; p < nranks_; ++p)
    if (remote[static_cast<size_t>(p)]) store.set(key(rank_, p), ib_->localDescriptor(p));
  for (int p = 0; p < nranks_; ++p) {
    if (!remote[static_cast<size_t>(p)]) continue;
    ib_->connect(p, store.get(key(p, rank_)));
    RLOG_INFO("rank %d -> rank %d: ib queue pair connected", rank_, p);
  }
}

}  // namespace resident
