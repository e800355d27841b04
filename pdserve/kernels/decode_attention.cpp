// Decode attention over the paged KV pool: one query row per sequence, online softmax in tiles.
// Invariant: reads only the keys [key_start, key_end) of each row (plus its own new key when
// given) from the pages its block table names, and allocates nothing that grows with the context.
// Attention sinks (gpt-oss), when given, are one logit per query head that joins every row's
// softmax denominator and weighs no value; they are folded in once, after the key ranges merge.

#include "kernels.h"
#include "kv_elements.h"

namespace pdserve::kernels {

// ---- paged decode attention -----------------------------------------------------------------
//
// One query row attends to its keys in tiles of kKeyTile: the tile's scores for every query head
// of a KV head, their exponentials (an online softmax across tiles), then the tile's values
// weighted into per-head accumulators. A long context is split into key ranges that threads
// attend to independently; the partial softmax states of one (row, KV head) are merged at the end.
// The pages may hold float32, bfloat16 or float16 (T below): each loop widens them in registers
// and sums in float32, so a 16-bit pool halves the bytes read for one conversion per load.

namespace {

constexpr int64_t kKeyTile = 64;  // keys scored at once; bounds the per-task scratch
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kKeysPerSplit = 64;  // the shortest key range a thread is given on its own
// Multiply-adds below which one thread attends (~60 keys of a 9-head layer of 64): a parallel
// region costs a few microseconds, and above this two threads read the pages faster than one
// (bench/decode_attention.py, 264 keys: 45 -> 33 us a call; 400 keys: 84 -> 47 us).
constexpr int64_t kParallelAttentionWork = 1 << 16;

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
#if PDSERVE_AVX2
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    return horizontal_sum(acc);
  }
#endif
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * to_float(b[i]);
  return total;
}

#if PDSERVE_AVX2
// The eight horizontal sums of a[0..7], in order, as one vector.
inline __m256 horizontal_sums8(const __m256 (&a)[8]) {
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
#endif

// Where the token rows (every KV head) of keys (or values) [begin, begin + count) lie.
template <typename T>
void token_rows(const PagedCache& cache, const int32_t* table, int64_t begin, int64_t count, const T** out) {
  int64_t block_index = begin / cache.block_size, offset = begin % cache.block_size;
  const T* page = nullptr;
  for (int64_t t = 0; t < count; ++t) {
    if (t == 0 || offset == 0) {
      const int64_t block = table[block_index];
      TORCH_CHECK(block >= 0 && block < cache.num_blocks, "paged_decode_attention: block id ", block, " out of range");
      page = cache.elements<T>() + block * cache.block_stride;
    }
    out[t] = page + offset * cache.token_stride;
    if (++offset == cache.block_size) {
      offset = 0;
      ++block_index;
    }
  }
}

// Online softmax state of `group` query heads sharing one KV head, over the keys seen so far:
// acc[g] = sum_t e^(s[g][t] - max[g]) v_t and sum[g] = sum_t e^(s[g][t] - max[g]).
struct SoftmaxState {
  int64_t group = 0, head_dim = 0;
  float max[kMaxGroup];
  float sum[kMaxGroup];
  float* acc = nullptr;  // [group, head_dim], owned by the caller

  void reset(int64_t group_, int64_t head_dim_, float* acc_) {
    group = group_, head_dim = head_dim_, acc = acc_;
    for (int64_t g = 0; g < group; ++g) {
      max[g] = -std::numeric_limits<float>::infinity();
      sum[g] = 0.f;
    }
    std::fill(acc, acc + group * head_dim, 0.f);
  }

  // scores[g][t] = scale * q[g] . (keys[t] + at)
  template <typename T>
  void score(const float* q, const T* const* keys, int64_t at, int64_t count, float scale,
             float (*scores)[kKeyTile]) const {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      int64_t t = 0;
#if PDSERVE_AVX2
      if (head_dim % 8 == 0) {  // eight keys at a time: eight independent FMA chains
        for (; t + 8 <= count; t += 8) {
          __m256 partial[8];
          for (int j = 0; j < 8; ++j) partial[j] = _mm256_setzero_ps();
          for (int64_t i = 0; i < head_dim; i += 8) {
            const __m256 qv = _mm256_loadu_ps(qg + i);
            for (int j = 0; j < 8; ++j) partial[j] = _mm256_fmadd_ps(load8(keys[t + j] + at + i), qv, partial[j]);
          }
          _mm256_storeu_ps(scores[g] + t, _mm256_mul_ps(horizontal_sums8(partial), _mm256_set1_ps(scale)));
        }
      }
#endif
      for (; t < count; ++t) scores[g][t] = dot(qg, keys[t] + at, head_dim) * scale;
    }
  }

  // Turns scores into weights e^(s - max) and rescales what came before to the new maximum.
  void exponentiate(float (*scores)[kKeyTile], int64_t count) {
    for (int64_t g = 0; g < group; ++g) {
      float tile_max = max[g];
      for (int64_t t = 0; t < count; ++t) tile_max = std::max(tile_max, scores[g][t]);
      const float rescale = std::exp(max[g] - tile_max);  // 0 on the first tile (max was -inf)
      float tile_sum = 0.f;
      int64_t t = 0;
#if PDSERVE_AVX2
      const __m256 shift = _mm256_set1_ps(tile_max);
      __m256 sums = _mm256_setzero_ps();
      for (; t + 8 <= count; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores[g] + t), shift));
        _mm256_storeu_ps(scores[g] + t, e);
        sums = _mm256_add_ps(sums, e);
      }
      tile_sum = horizontal_sum(sums);
#endif
      for (; t < count; ++t) {
        scores[g][t] = std::exp(scores[g][t] - tile_max);
        tile_sum += scores[g][t];
      }
      if (rescale != 1.f) {
        for (int64_t i = 0; i < head_dim; ++i) acc[g * head_dim + i] *= rescale;
      }
      sum[g] = sum[g] * rescale + tile_sum;
      max[g] = tile_max;
    }
  }

  // acc[g] += sum_t weights[g][t] * (values[t] + at)
  template <typename T>
  void accumulate(const float (*weights)[kKeyTile], const T* const* values, int64_t at, int64_t count) {
    for (int64_t g = 0; g < group; ++g) {
      float* out = acc + g * head_dim;
      int64_t i = 0;
#if PDSERVE_AVX2
      for (; i + 64 <= head_dim; i += 64) {  // 64 dims at a time: eight independent FMA chains
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(out + i + 8 * j);
        for (int64_t t = 0; t < count; ++t) {
          const __m256 w = _mm256_set1_ps(weights[g][t]);
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(w, load8(values[t] + at + i + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + i + 8 * j, a[j]);
      }
#endif
      for (int64_t t = 0; t < count; ++t) {
        for (int64_t d = i; d < head_dim; ++d) out[d] += weights[g][t] * to_float(values[t][at + d]);
      }
    }
  }

  template <typename T>
  void add(const float* q, const T* const* keys, const T* const* values, int64_t at, int64_t count, float scale) {
    float scores[kMaxGroup][kKeyTile];
    score(q, keys, at, count, scale, scores);
    exponentiate(scores, count);
    accumulate(scores, values, at, count);
  }

  // Folds another state over other keys of the same heads into this one.
  void merge(const SoftmaxState& other) {
    for (int64_t g = 0; g < group; ++g) {
      if (other.max[g] == -std::numeric_limits<float>::infinity()) continue;  // saw no key
      const float top = std::max(max[g], other.max[g]);
      const float mine = std::exp(max[g] - top), theirs = std::exp(other.max[g] - top);
      for (int64_t i = 0; i < head_dim; ++i) {
        acc[g * head_dim + i] = acc[g * head_dim + i] * mine + other.acc[g * head_dim + i] * theirs;
      }
      sum[g] = sum[g] * mine + other.sum[g] * theirs;
      max[g] = top;
    }
  }

  // Adds a logit per head that counts in the denominator and carries no value (an attention sink).
  void add_sinks(const float* sinks) {
    for (int64_t g = 0; g < group; ++g) {
      const float top = std::max(max[g], sinks[g]);
      const float mine = std::exp(max[g] - top);  // 0 when no key was seen (max is -inf)
      for (int64_t i = 0; i < head_dim; ++i) acc[g * head_dim + i] *= mine;
      sum[g] = sum[g] * mine + std::exp(sinks[g] - top);
      max[g] = top;
    }
  }

  void write(float* out) const {
    for (int64_t g = 0; g < group; ++g) {
      const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
      for (int64_t i = 0; i < head_dim; ++i) out[g * head_dim + i] = acc[g * head_dim + i] * inv;
    }
  }
};

// Asks for every cache line of the token rows of every KV head (rows[t] + h * head_stride, head_dim
// elements each) to be on its way: a head's keys of one block fill one 4 KiB page of the pool (the
// layout keeps heads and layers apart), and in a decode step they were last read a whole model
// ago, so each page starts cold, in memory and the TLB, where the hardware's prefetcher stops at
// page boundaries. Asking for the next tile while attending to this one keeps those misses in
// flight together: attention 1.06-1.12x faster in steps (bench.kernels decode-ab), though an
// isolated call, its pages warm, runs ~10% slower.
template <typename T>
void prefetch_rows(const T* const* rows, int64_t count, int64_t kv_heads, int64_t head_stride, int64_t head_dim) {
#if PDSERVE_AVX2
  constexpr int64_t kLineElements = 64 / sizeof(T);
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const char* row = reinterpret_cast<const char*>(rows[t] + h * head_stride);
      for (int64_t i = 0; i < head_dim; i += kLineElements) _mm_prefetch(row + i * sizeof(T), _MM_HINT_T0);
    }
  }
#else
  (void)rows, (void)count, (void)kv_heads, (void)head_stride, (void)head_dim;
#endif
}

// Folds keys [begin, end) of every KV head of one row (from the pages) into states[h], then the
// row's own new keys when given ([kv_heads, head_dim]). Tile by tile, every head in turn, so that
// each tile's token rows are read from memory once; the next tile's are prefetched meanwhile.
template <typename T>
void attend_range(SoftmaxState* states, int64_t kv_heads, const float* q, const PagedCache& keys,
                  const PagedCache& values, const int32_t* table, int64_t begin, int64_t end, const float* new_keys,
                  const float* new_values, float scale) {
  const int64_t group = states[0].group, head_dim = states[0].head_dim;
  const T* rows[2][2][kKeyTile];  // [tile parity][keys, values][token]
  int64_t count = std::min(kKeyTile, end - begin);
  if (count > 0) {
    token_rows<T>(keys, table, begin, count, rows[0][0]);
    token_rows<T>(values, table, begin, count, rows[0][1]);
    prefetch_rows(rows[0][0], count, kv_heads, keys.head_stride, head_dim);
    prefetch_rows(rows[0][1], count, kv_heads, values.head_stride, head_dim);
  }
  for (int64_t tile = begin, parity = 0; tile < end; tile += kKeyTile, parity ^= 1) {
    const int64_t next_count = std::min(kKeyTile, end - tile - count);
    if (next_count > 0) {
      token_rows<T>(keys, table, tile + count, next_count, rows[parity ^ 1][0]);
      token_rows<T>(values, table, tile + count, next_count, rows[parity ^ 1][1]);
      prefetch_rows(rows[parity ^ 1][0], next_count, kv_heads, keys.head_stride, head_dim);
      prefetch_rows(rows[parity ^ 1][1], next_count, kv_heads, values.head_stride, head_dim);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      states[h].add(q + h * group * head_dim, rows[parity][0], rows[parity][1], h * keys.head_stride, count, scale);
    }
    count = next_count;
  }
  if (new_keys == nullptr) return;
  for (int64_t h = 0; h < kv_heads; ++h) {
    states[h].add<float>(q + h * group * head_dim, &new_keys, &new_values, h * head_dim, 1, scale);
  }
}

void check_new_kv(const std::optional<at::Tensor>& t, int64_t rows, int64_t kv_heads, int64_t head_dim) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == rows && t->size(1) == kv_heads &&
                  t->size(2) == head_dim,
              "paged_decode_attention: new k/v must be float32 [rows, kv_heads, head_dim]");
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& key_start,
                                  const at::Tensor& key_end, const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new, double scale,
                                  const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_decode_attention: q must be float32 [rows, heads, dim]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "paged_decode_attention: int32 block table");
  TORCH_CHECK(key_start.scalar_type() == at::kInt && key_end.scalar_type() == at::kInt, "paged_decode_attention: int32 bounds");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "paged_decode_attention: give both new k and new v, or neither");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && v_cache.sizes() == k_cache.sizes(), "paged_decode_attention: cache shape");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "paged_decode_attention: K and V caches of one dtype");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "paged_decode_attention: head grouping");
  TORCH_CHECK(block_table.size(0) == rows && key_start.numel() == rows && key_end.numel() == rows,
              "paged_decode_attention: one table row and one key range per query row");
  check_new_kv(k_new, rows, kv_heads, head_dim);
  check_new_kv(v_new, rows, kv_heads, head_dim);
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->numel() == heads),
              "paged_decode_attention: sinks must be float32 [heads]");
  const at::Tensor sink_logits = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  const float* sink_data = sink_logits.defined() ? sink_logits.data_ptr<float>() : nullptr;
  const PagedCache keys = paged_cache(k_cache), values = paged_cache(v_cache);
  const at::Tensor qc = q.contiguous(), table = block_table.contiguous();
  const at::Tensor starts = key_start.contiguous(), ends = key_end.contiguous();
  const at::Tensor kn = k_new.has_value() ? k_new->contiguous() : at::Tensor();
  const at::Tensor vn = v_new.has_value() ? v_new->contiguous() : at::Tensor();
  const int64_t width = table.size(1), block_size = keys.block_size;
  const int32_t* start_data = starts.data_ptr<int32_t>();
  const int32_t* end_data = ends.data_ptr<int32_t>();
  int64_t work = 0, longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(0 <= start_data[r] && start_data[r] <= end_data[r] && end_data[r] <= width * block_size,
                "paged_decode_attention: key range of row ", r, " does not fit its block table");
    TORCH_CHECK(end_data[r] > start_data[r] || kn.defined(), "paged_decode_attention: row ", r, " sees no key");
    work += (end_data[r] - start_data[r] + 1) * heads * head_dim * 2;
    longest = std::max<int64_t>(longest, end_data[r] - start_data[r]);
  }
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  const int64_t group = heads / kv_heads;
  const float* q_data = qc.data_ptr<float>();
  const int32_t* table_data = table.data_ptr<int32_t>();
  const float* kn_data = kn.defined() ? kn.data_ptr<float>() : nullptr;
  const float* vn_data = vn.defined() ? vn.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();

  // Tasks are (row, split): split s of a row attends, for every KV head, to the s-th of `splits`
  // equal key ranges (the last split also to the row's new keys). Few rows with long contexts
  // get enough splits to keep every thread busy; a small step runs on the calling thread alone.
  const bool parallel = work >= kParallelAttentionWork && at::get_num_threads() > 1;
  int64_t splits = 1;
  if (parallel && rows < 2 * at::get_num_threads()) {
    const int64_t wanted = (2 * at::get_num_threads() + rows - 1) / rows;
    splits = std::max<int64_t>(1, std::min(wanted, longest / kKeysPerSplit));
    // Whole tasks per thread: 3 tasks on 2 threads leave one thread idle a third of the call.
    while (splits > 1 && (rows * splits) % at::get_num_threads() != 0) --splits;
  }
  const int64_t num_tasks = rows * splits;
  std::vector<float> scratch(num_tasks * heads * head_dim);
  std::vector<SoftmaxState> states(num_tasks * kv_heads);
  with_kv_element(keys.dtype, "paged_decode_attention", [&](auto element) {
    using T = decltype(element);
    at::parallel_for(0, num_tasks, parallel ? 1 : std::max<int64_t>(num_tasks, 1), [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t r = task / splits, s = task % splits;
        const int64_t begin = start_data[r], length = end_data[r] - begin;
        const bool owns_new_keys = kn_data != nullptr && s == splits - 1;
        SoftmaxState* task_states = states.data() + task * kv_heads;
        for (int64_t h = 0; h < kv_heads; ++h) {
          task_states[h].reset(group, head_dim, scratch.data() + (task * kv_heads + h) * group * head_dim);
        }
        attend_range<T>(task_states, kv_heads, q_data + r * heads * head_dim, keys, values, table_data + r * width,
                       begin + length * s / splits, begin + length * (s + 1) / splits,
                       owns_new_keys ? kn_data + r * kv_heads * head_dim : nullptr,
                       owns_new_keys ? vn_data + r * kv_heads * head_dim : nullptr, static_cast<float>(scale));
      }
    });
  });
  for (int64_t r = 0; r < rows; ++r) {
    SoftmaxState* row_states = states.data() + r * splits * kv_heads;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t s = 1; s < splits; ++s) row_states[h].merge(row_states[s * kv_heads + h]);
      if (sink_data != nullptr) row_states[h].add_sinks(sink_data + h * group);
      row_states[h].write(out_data + (r * heads + h * group) * head_dim);
    }
  }
  return out;
}

}  // namespace pdserve::kernels
