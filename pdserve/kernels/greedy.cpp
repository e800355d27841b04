// The greedy token choice: each row's first largest logit, in two passes over the row.
// Invariant: a row holding a NaN or an infinity yields the failed-token id, never a token.

#include "kernels.h"

namespace pdserve::kernels {

// ---- greedy choice ----------------------------------------------------------------------------
//
// Per row of float32 logits [rows, vocab]: the first index of the largest value, as float64 (the
// sampler's packed form: ids are exact in float64), or -1 when the row holds a NaN or an
// infinity, which the sampler fails alone. One pass for the maximum and finiteness, one to find
// where it is: what argmax, isfinite().all() and amax() take six passes and temporaries for.

namespace {

constexpr double kFailedToken = -1.0;  // pdserve.runner.sampler.FAILED_TOKEN_ID

double greedy_row(const float* x, int64_t vocab) {
  int64_t i = 0;
  float largest = -std::numeric_limits<float>::infinity();
  bool finite = true;
#if PDSERVE_AVX2
  __m256 top = _mm256_set1_ps(largest);
  __m256 broken = _mm256_setzero_ps();  // lanes where some x - x was not 0 (x NaN or infinite)
  for (; i + 8 <= vocab; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top = _mm256_max_ps(top, v);
    broken = _mm256_or_ps(broken, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ));
  }
  finite = _mm256_movemask_ps(broken) == 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  for (float lane : lanes) largest = std::max(largest, lane);
#endif
  for (; i < vocab; ++i) {
    finite = finite && std::isfinite(x[i]);
    largest = std::max(largest, x[i]);
  }
  if (!finite || vocab == 0) return kFailedToken;
  for (int64_t j = 0; j < vocab; ++j) {
    if (x[j] == largest) return static_cast<double>(j);
  }
  return kFailedToken;
}

}  // namespace

at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "greedy_tokens: logits must be float32 [rows, vocab] on the CPU");
  const at::Tensor lc = logits.contiguous();
  const int64_t rows = lc.size(0), vocab = lc.size(1);
  at::Tensor out = at::empty({rows, 1}, lc.options().dtype(at::kDouble));
  const float* x = lc.data_ptr<float>();
  double* ids = out.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) ids[r] = greedy_row(x + r * vocab, vocab);
  return out;
}

}  // namespace pdserve::kernels
