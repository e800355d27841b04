// One tensor-parallel rank's all-reduce over the shared segment of pdserve.parallel.host_segment,
// in native code (host_exchange.cpp): the same protocol as pdserve.parallel.host_collectives, so
// the two interleave on one sequence of exchanges (Python's broadcasts, then native all-reduces).
//
//   exchange s (buffer s % 2):  copy this rank's floats into its slot   -> store flag[rank] = s, wake
//                               spin, then sleep on a peer's flag (futex) until every flag >= s
//                               sum the slots in rank order (rank 0 first), in float32, into the tensor
//
// The segment (its layout is drawn in host_segment.py):
//
//   base +-------------+------------+------------+----+--------------------------+---------------------+
//        | magic nonce | line of r0 | line of r1 | .. | buffer 0: slot r0 | r1 ..| buffer 1: slot r0 | .. |
//        +-------------+------------+------------+----+--------------------------+---------------------+
//        flags_offset + line_bytes * r: rank r's int64 flag          data_offset: the slots, slot_bytes each
//
// Invariant: every rank adds the slots in the same order, so every rank holds the same bits after
// an all-reduce (Python's torch.add over the same slots gives the same bits too). Every wait is
// bounded by `timeout_s`, and a watched peer whose process ended (its pidfd readable) ends it at
// once; either failure raises an error whose message starts with kRanksLost, which Python turns
// into RanksLost. The mapping outlives every call: Python's HostCollectives holds this object and
// the HostSegment whose mmap it points into, and HostSegment.close never unmaps (the mapping goes
// with its last Python reference), so a wait still running in another thread when the ranks close
// reads mapped memory; `forget` only makes later calls fail.

#pragma once

#include <torch/custom_class.h>

#include <atomic>
#include <string>
#include <vector>

namespace pdserve::kernels {

inline constexpr const char* kRanksLost = "ranks lost: ";

struct HostExchange : torch::CustomClassHolder {
  HostExchange(int64_t base_address, int64_t num_ranks, int64_t rank, int64_t slot_bytes, int64_t data_offset,
               int64_t flags_offset, int64_t line_bytes, std::vector<int64_t> watched_ranks,
               std::vector<int64_t> watched_pidfds, double spin_s, double check_s, double timeout_s, bool use_futex);

  // Sums `tensor` (float32, contiguous, on the CPU) over the ranks in place, in exchanges
  // sequence + 1, sequence + 2, ... (one per slot's worth); returns the last one used.
  int64_t all_reduce(at::Tensor tensor, int64_t sequence);
  // The ranks are closing: every later call fails (a call already waiting runs on).
  void forget();

  char* base = nullptr;
  std::atomic<bool> forgotten{false};
  int64_t num_ranks = 0, rank = 0, slot_bytes = 0, data_offset = 0, flags_offset = 0, line_bytes = 0;
  std::vector<int64_t> watched_ranks, watched_pidfds;  // pairs: a peer's rank, the pidfd that watches it
  double spin_s = 0, check_s = 0, timeout_s = 0;
  bool use_futex = false;

 private:
  int64_t* flag(int64_t of_rank) const;
  float* slot(int64_t buffer, int64_t of_rank) const;
  void publish(int64_t sequence) const;
  void wait_for(int64_t sequence) const;
  std::vector<int64_t> exited_peers() const;
};

}  // namespace pdserve::kernels
