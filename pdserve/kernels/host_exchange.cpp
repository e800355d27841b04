// HostExchange (host_exchange.h): a rank's all-reduce over the shared segment, without Python
// between the ranks' flags.

#include "host_exchange.h"

#include <linux/futex.h>
#include <poll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

namespace pdserve::kernels {

namespace {

double monotonic_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

timespec span_of(double seconds) {
  seconds = std::max(seconds, 0.0);
  timespec span{};
  span.tv_sec = static_cast<time_t>(seconds);
  span.tv_nsec = static_cast<long>((seconds - static_cast<double>(span.tv_sec)) * 1e9);
  return span;
}

std::string rank_list(const std::vector<int64_t>& ranks) {
  std::ostringstream text;
  text << "[";
  for (size_t i = 0; i < ranks.size(); ++i) text << (i ? ", " : "") << ranks[i];
  text << "]";
  return text.str();
}

}  // namespace

HostExchange::HostExchange(int64_t base_address, int64_t num_ranks_, int64_t rank_, int64_t slot_bytes_,
                           int64_t data_offset_, int64_t flags_offset_, int64_t line_bytes_,
                           std::vector<int64_t> watched_ranks_, std::vector<int64_t> watched_pidfds_, double spin_s_,
                           double check_s_, double timeout_s_, bool use_futex_)
    : base(reinterpret_cast<char*>(base_address)), num_ranks(num_ranks_), rank(rank_), slot_bytes(slot_bytes_),
      data_offset(data_offset_), flags_offset(flags_offset_), line_bytes(line_bytes_),
      watched_ranks(std::move(watched_ranks_)), watched_pidfds(std::move(watched_pidfds_)), spin_s(spin_s_),
      check_s(check_s_), timeout_s(timeout_s_), use_futex(use_futex_) {
  TORCH_CHECK(base != nullptr && num_ranks >= 2 && rank >= 0 && rank < num_ranks, "HostExchange: a rank of a segment");
  TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0 && line_bytes % 8 == 0 && flags_offset % 8 == 0,
              "HostExchange: slots of whole cache lines, flags aligned");
  TORCH_CHECK(timeout_s > 0 && check_s > 0 && spin_s >= 0, "HostExchange: positive waits");
  TORCH_CHECK(watched_ranks.size() == watched_pidfds.size(), "HostExchange: one pidfd per watched rank");
}

int64_t* HostExchange::flag(int64_t of_rank) const {
  return reinterpret_cast<int64_t*>(base + flags_offset + line_bytes * of_rank);
}

float* HostExchange::slot(int64_t buffer, int64_t of_rank) const {
  return reinterpret_cast<float*>(base + data_offset + (buffer * num_ranks + of_rank) * slot_bytes);
}

void HostExchange::publish(int64_t sequence) const {
  int64_t* own = flag(rank);
  __atomic_store_n(own, sequence, __ATOMIC_RELEASE);  // the slot's bytes before the flag
  if (use_futex) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(own), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }
}

std::vector<int64_t> HostExchange::exited_peers() const {
  std::vector<pollfd> fds;
  for (int64_t fd : watched_pidfds) fds.push_back(pollfd{static_cast<int>(fd), POLLIN, 0});
  std::vector<int64_t> exited;
  if (fds.empty() || poll(fds.data(), fds.size(), 0) <= 0) return exited;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents != 0) exited.push_back(watched_ranks[i]);
  }
  std::sort(exited.begin(), exited.end());
  return exited;
}

void HostExchange::wait_for(int64_t sequence) const {
  const double started_s = monotonic_s();
  const double spin_until_s = started_s + spin_s, deadline_s = started_s + timeout_s;
  while (true) {
    int64_t behind = -1, seen = 0;
    for (int64_t peer = 0; peer < num_ranks; ++peer) {
      if (peer == rank) continue;
      const int64_t value = __atomic_load_n(flag(peer), __ATOMIC_ACQUIRE);
      if (value < sequence) {
        behind = peer;
        seen = value;
        break;
      }
    }
    if (behind < 0) return;
    const double now_s = monotonic_s();
    if (now_s < spin_until_s) {
      _mm_pause();
      continue;
    }
    if (now_s >= deadline_s) {
      std::vector<int64_t> missing;
      for (int64_t peer = 0; peer < num_ranks; ++peer) {
        if (peer != rank && __atomic_load_n(flag(peer), __ATOMIC_ACQUIRE) < sequence) missing.push_back(peer);
      }
      TORCH_CHECK(false, kRanksLost, "no word from rank(s) ", rank_list(missing), " within ", timeout_s, " s");
    }
    const std::vector<int64_t> exited = exited_peers();
    TORCH_CHECK(exited.empty(), kRanksLost, "rank(s) ", rank_list(exited), " exited");
    const double pause_s = std::min(check_s, deadline_s - now_s);
    if (use_futex) {
      const timespec span = span_of(pause_s);
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(flag(behind)), FUTEX_WAIT, static_cast<uint32_t>(seen), &span,
              nullptr, 0);
    } else {
      const timespec span = span_of(std::min(100e-6, pause_s));
      nanosleep(&span, nullptr);
    }
  }
}

int64_t HostExchange::all_reduce(at::Tensor tensor, int64_t sequence) {
  TORCH_CHECK(!forgotten.load(), "HostExchange: the ranks' segment was closed");
  TORCH_CHECK(tensor.device().is_cpu() && tensor.scalar_type() == at::kFloat && tensor.is_contiguous(),
              "HostExchange.all_reduce: a contiguous float32 CPU tensor");
  float* data = tensor.data_ptr<float>();
  const int64_t count = tensor.numel();
  const int64_t slot_floats = slot_bytes / static_cast<int64_t>(sizeof(float));
  for (int64_t start = 0; start < count; start += slot_floats) {  // a slot's worth an exchange, as in Python
    const int64_t n = std::min(slot_floats, count - start);
    ++sequence;
    const int64_t buffer = sequence % 2;
    std::memcpy(slot(buffer, rank), data + start, static_cast<size_t>(n) * sizeof(float));
    publish(sequence);
    wait_for(sequence);
    float* out = data + start;
    const float* first = slot(buffer, 0);
    const float* second = slot(buffer, 1);
    for (int64_t i = 0; i < n; ++i) out[i] = first[i] + second[i];
    for (int64_t peer = 2; peer < num_ranks; ++peer) {
      const float* next = slot(buffer, peer);
      for (int64_t i = 0; i < n; ++i) out[i] += next[i];
    }
  }
  return sequence;
}

void HostExchange::forget() { forgotten.store(true); }

}  // namespace pdserve::kernels
