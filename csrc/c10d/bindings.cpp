// Python module resident_pg._C: the backend constructor handed to
// torch.distributed.Backend.register_backend, and introspection.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "c10d/ep_bindings.hpp"
#include "c10d/process_group_resident.hpp"
#include "core/log.hpp"
#include "core/options.hpp"
#include "core/shm_segment.hpp"
#include "core/transport/ib/ib_caps.hpp"
#include "core/transport/tcp_address.hpp"

namespace py = pybind11;
using resident::ProcessGroupResident;

PYBIND11_MODULE(_C, m) {
  m.doc() = "resident_pg: resident small-message backend for torch.distributed";
  py::class_<ProcessGroupResident, c10d::Backend, c10::intrusive_ptr<ProcessGroupResident>>(
      m, "ProcessGroupResident")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout,
                       const std::map<std::string, std::string>& options,
                       const std::vector<int>& global_ranks) {
             return c10::make_intrusive<ProcessGroupResident>(store, rank, size, timeout, options,
                                                              global_ranks);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("options") = std::map<std::string, std::string>{},
           py::arg("global_ranks") = std::vector<int>{}, py::call_guard<py::gil_scoped_release>())
      .def("transport_for", &ProcessGroupResident::transportFor, py::arg("peer"),
           "Transport used to reach a peer: 'shm' (same host), 'tcp' (another host, or "
           "RESIDENT_TRANSPORT=tcp) or 'self'.")
      .def("path_for", &ProcessGroupResident::pathFor, py::arg("peer"),
           "Path used to reach a peer: 'direct' stores or the 'proxy' thread.")
      .def("config", &ProcessGroupResident::describeConfig,
           "The effective RESIDENT_* configuration of this group.")
      .def("proxy_cpu", &ProcessGroupResident::proxyCpu,
           "CPU the proxy thread is pinned to, or -1.")
      .def("tcp_endpoint", &ProcessGroupResident::tcpEndpoint,
           "'address:port' this rank's tcp peers connect to (RESIDENT_TCP_ADDR, else the route "
           "to the rendezvous host), or '' without tcp peers.")
      .def("all_to_all_device_splits", &ProcessGroupResident::allToAllDeviceSplits,
           py::arg("output"), py::arg("input"), py::arg("send_rows"), py::arg("recv_rows"),
           py::arg("async_op") = false, py::arg("counts_out") = false,
           py::call_guard<py::gil_scoped_release>(),
           "all_to_all of [group size, max_rows, ...] buffers moving only send_rows[p] rows to "
           "peer p and recv_rows[p] from it (counts [group size], or [group size, n] summed per "
           "peer); on CUDA the counts are read by the kernel; counts_out (CUDA): recv_rows is "
           "written from counts sent ahead of the rows "
           "(resident_pg.ep.all_to_all_device_splits).")
      .def("_set_handoff", &ProcessGroupResident::setHandoff, py::arg("backend"), py::arg("device"),
           py::arg("crossover_bytes"),
           "Hands ops on `device` tensors whose bytes reach crossover_bytes[op kind] to `backend` "
           "(docs/handoff.md). Set by resident_pg._backend; set it on every rank alike.")
      .def("_set_handoff_off", &ProcessGroupResident::setHandoffOff, py::arg("reason"),
           "Turns the hand-off off; `reason` is what handoff() reports.")
      // torch binds get_error on Backend from 2.14 on, on ProcessGroupNCCL alone before.
      .def("get_error", &ProcessGroupResident::getError,
           "SUCCESS, TIMEOUT, REMOTE_ERROR (a peer died, or its group or connection failed) or "
           "COMM_ERROR (docs/ops.md).")
      .def("handoff_bytes", &ProcessGroupResident::handoffBytes,
           "The group's RESIDENT_HANDOFF_BYTES.")
      .def(
          "handoff",
          [](const ProcessGroupResident& pg) {
            const resident::Handoff& h = pg.handoff();
            py::dict d;
            d["on"] = h.on();
            d["backend"] = h.on() ? py::object(py::str(h.innerName())) : py::object(py::none());
            d["device"] = h.on() ? py::object(py::str(c10::DeviceTypeName(h.device(), true)))
                                 : py::object(py::none());
            d["reason"] = h.reason();
            py::dict crossover, forwarded;
            for (int i = 0; i < resident::kHandoffOps; ++i) {
              const char* name = resident::kHandoffOpNames[static_cast<size_t>(i)];
              crossover[name] = h.crossover(i);
              forwarded[name] = h.forwarded(i);
            }
            d["crossover_bytes"] = crossover;
            d["forwarded"] = forwarded;
            return d;
          },
          "The hand-off: on, the inner backend and device, the reason when off, the crossover "
          "bytes and the count of ops forwarded, per op kind.");
  m.def(
      "transports",
      [] {
        return std::vector<std::string>{"ib", "shm", "tcp"};
      },
      "Transports this build has (ib: built and unit-tested, not yet run on RDMA hardware).");
  m.def(
      "ib_available",
      [] {
        std::string why;
        const bool ok = resident::ib::ibAvailable(&why);
        return std::make_pair(ok, why);
      },
      "(True, '') when this machine has an active RDMA port, else (False, reason).");
  m.def(
      "tcp_listen_address",
      [](const std::string& setting, const std::string& rendezvous_host) {
        const resident::ListenAddress a = resident::chooseListenAddress(setting, rendezvous_host);
        return std::make_pair(a.address, a.reason);
      },
      py::arg("setting"), py::arg("rendezvous_host"),
      "(address, how it was chosen): where the tcp transport of a group would listen, given "
      "RESIDENT_TCP_ADDR's value ('' unset) and the rendezvous store's host ('' unknown). "
      "ValueError when the setting is neither an address nor an interface with one.");
  m.def("remove_stale_segments", &resident::ShmSegment::removeStale,
        "Remove /dev/shm names left by resident processes that no longer exist.");
  m.def(
      "options",
      [] {
        py::list out;
        for (const resident::OptionSpec& s : resident::optionSpecs()) {
          py::dict d;
          d["key"] = s.key;
          d["variable"] = resident::variableName(s.key);
          d["kind"] = resident::kindName(s.kind);
          d["tier"] = resident::tierName(s.tier);
          d["default"] = s.default_value;
          d["min"] = s.min;
          d["max"] = s.max;
          d["choices"] = s.choices;
          d["doc"] = s.doc;
          d["reader"] = s.reader;
          d["pg_option"] = s.pg_option;
          out.append(d);
        }
        return out;
      },
      "The option registry (csrc/core/options.def): a dict per RESIDENT_* option, removed ones "
      "included (tier 'removed', doc: why).");
  m.def(
      "_log_info", [](const std::string& message) { RLOG_INFO("%s", message.c_str()); },
      py::arg("message"), "Writes `message` through the RESIDENT_DEBUG logger at level info.");
  resident::bindEpKernels(m);
  m.def("set_log_level",
        [](int level) { resident::setLogLevel(static_cast<resident::LogLevel>(level)); });
}
