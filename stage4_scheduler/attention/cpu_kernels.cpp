// Decode attention that reads the paged KV cache in place, on a CPU (cpu_backend.py builds this
// file once with torch's C++ extension loader and calls it). One pass over a request's keys, the
// online softmax of flash-decoding, a block of BLOCK keys at a time, for every query head h (the
// G = H / KVH heads of one K/V head share its rows):
//
//     s[h, j] = scale * q[b, h] . k[slot(b, j)]                 scores of the block's keys
//     m'      = max(m, max_j s[h, j]);  acc, l *= exp(m - m')   a larger maximum rescales the past
//     p[h, j] = exp(s[h, j] - m');  l += sum_j p;  acc += sum_j p[h, j] * v[slot(b, j)]
//   out[b, h] = acc / l
//
// slot(b, j) = page_table[req_rows[b], j / page_size] * page_size + j % page_size: the same lookup
// as the torch backend's kv_indices, done while reading instead of copying the keys out first.
// Every key and value row is read from memory once per step and layer, for the G query heads that
// share it; nothing is written but the output. Threads take requests one at a time (a request's
// K/V heads go to different threads when requests are fewer than threads). Arithmetic is float32
// whatever the cache's dtype (bfloat16 rows are widened as they are read), in ATen's portable
// vectors (at::vec: AVX-512, AVX2, NEON... chosen when cpu_backend.py builds the file; SGLang's CPU
// kernels are written the same way). On AVX-512 with head_dim 64 or 128, attend_avx512 does the
// same pass in fewer instructions (a block's 16 scores summed as one vector, the output kept in
// registers, the next block's rows prefetched): 1.3x (float32) to 1.5x (bfloat16) the portable
// pass on a 2-core Zen 5 (`python -m common.bench profile`, per layer call).
// A cache may be any strided view whose head_dim is dense (one layer of the pool is a view into
// all layers).

#include <torch/extension.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>

using Vec = at::vec::Vectorized<float>;

constexpr int64_t MAX_HEADS = 64;     // query heads (of this rank)
constexpr int64_t MAX_HEAD_DIM = 256;
constexpr int64_t BLOCK = 16;         // keys scored before their values are read

// Rows of one token, widened to float32: a float32 cache is read where it lies.
template <typename T>
static inline const float* as_float(const T* row, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = float(row[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* row, int64_t, float*) { return row; }

static inline float dot(const float* a, const float* b, int64_t n) {
  Vec sum(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    sum = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), sum);
  float total = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, sum);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

static inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
  const Vec wv(w);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    at::vec::fmadd(wv, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < n; ++d) y[d] += w * x[d];
}

struct Cache {  // a cache's base pointer and strides (elements); head_dim is dense
  const void* data;
  int64_t page, token, head;
};

// Where key (value) p of a request lies in the cache: its token's row of K/V head 0.
template <typename T>
static inline const T* token_row(const Cache& c, const int32_t* pages, int64_t p,
                                 int64_t page_size) {
  return static_cast<const T*>(c.data) + int64_t(pages[p / page_size]) * c.page +
         (p % page_size) * c.token;
}

// out[h0 + h] = acc[h] / l[h] for the NH heads of an item: the softmax's division, done once at
// the end of the online pass.
template <typename T>
static void write_out(T* out, const float* acc, const float* l, int64_t h0, int64_t NH, int64_t D,
                      int64_t len) {
  for (int64_t h = 0; h < NH; ++h) {
    const float inv = len > 0 ? 1.f / l[h] : 0.f;  // no keys: zeros
    for (int64_t d = 0; d < D; ++d) out[(h0 + h) * D + d] = T(acc[h * D + d] * inv);
  }
}

// Request b's keys for K/V heads [kv0, kv1): q [H, D] of the request in, out [H, D] out. A token's
// K (V) rows of every head lie together, so one pass reads them in the order they lie.
template <typename T>
static void attend(const T* q, T* out, const Cache& kc, const Cache& vc, int64_t kv0, int64_t kv1,
                   const int32_t* pages, int64_t len, int64_t page_size, int64_t G, int64_t D,
                   float scale) {
  const int64_t h0 = kv0 * G, NH = (kv1 - kv0) * G;  // the query heads of this item
  float qf[MAX_HEADS * MAX_HEAD_DIM], acc[MAX_HEADS * MAX_HEAD_DIM], row[MAX_HEAD_DIM];
  float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS][BLOCK];
  for (int64_t i = 0; i < NH * D; ++i) qf[i] = float(q[h0 * D + i]) * scale;
  std::fill(acc, acc + NH * D, 0.f);
  std::fill(m, m + NH, -INFINITY);
  std::fill(l, l + NH, 0.f);
  for (int64_t first = 0; first < len; first += BLOCK) {
    const int64_t n = std::min(BLOCK, len - first);
    for (int64_t j = 0; j < n; ++j) {  // scores: each key row read once for its G heads
      const T* token = token_row<T>(kc, pages, first + j, page_size);
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const float* key = as_float(token + kvh * kc.head, D, row);
        for (int64_t h = (kvh - kv0) * G; h < (kvh - kv0 + 1) * G; ++h)
          s[h][j] = dot(qf + h * D, key, D);
      }
    }
    for (int64_t h = 0; h < NH; ++h) {  // online softmax: new maximum, rescale, probabilities
      float block_max = m[h];
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, s[h][j]);
      const float correction = std::exp(m[h] - block_max);  // exp(-inf) = 0 at the first block
      if (correction != 1.f) {
        l[h] *= correction;
        for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= correction;
      }
      for (int64_t j = 0; j < n; j += Vec::size()) {  // p = exp(s - max), Vec::size() at a time
        const int64_t w = std::min<int64_t>(Vec::size(), n - j);
        (Vec::loadu(s[h] + j, w) - Vec(block_max)).exp_u20().store(s[h] + j, w);
      }
      for (int64_t j = 0; j < n; ++j) l[h] += s[h][j];
      m[h] = block_max;
    }
    for (int64_t j = 0; j < n; ++j) {  // values: each row read once for its G heads
      const T* token = token_row<T>(vc, pages, first + j, page_size);
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const float* value = as_float(token + kvh * vc.head, D, row);
        for (int64_t h = (kvh - kv0) * G; h < (kvh - kv0 + 1) * G; ++h)
          axpy(s[h][j], value, acc + h * D, D);
      }
    }
  }
  write_out(out, acc, l, h0, NH, D, len);
}

#if defined(CPU_CAPABILITY_AVX512)
// The same pass for head_dim D (a multiple of 16) on AVX-512, arranged so that nothing is
// reduced one lane at a time: a block's 16 scores of a head come out as one vector (sum_lanes),
// and a head's output stays in registers while the block's values are added in.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {  // 16 bfloat16 -> float32: the high half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

struct Halving {  // the lanes each step of sum_lanes adds: lo[r] + hi[r] of (a, b)
  __m512i lo[4], hi[4];
  Halving() {
    for (int level = 0, w = 16; w > 1; ++level, w /= 2) {
      alignas(64) int32_t a[16], b[16];
      for (int r = 0; r < 16; ++r) {  // lanes 0-7 from a (0-15), 8-15 from b (16-31)
        const int i = (r % 8) / (w / 2), s = (r % 8) % (w / 2);
        a[r] = (r < 8 ? 0 : 16) + i * w + s;
        b[r] = a[r] + w / 2;
      }
      lo[level] = _mm512_load_si512(a);
      hi[level] = _mm512_load_si512(b);
    }
  }
};

// v[j] -> lane j: the sum of v[j]'s 16 lanes. Four halvings of pairs (15 adds, 30 permutes)
// instead of 16 separate horizontal sums.
static inline __m512 sum_lanes(__m512 v[16], const Halving& hv) {
  for (int level = 0, count = 16; count > 1; ++level, count /= 2)
    for (int i = 0; i < count / 2; ++i)
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], hv.lo[level], v[2 * i + 1]),
                           _mm512_permutex2var_ps(v[2 * i], hv.hi[level], v[2 * i + 1]));
  return v[0];
}

template <typename T, int D>
static void attend_avx512(const T* q, T* out, const Cache& kc, const Cache& vc, int64_t kv0,
                          int64_t kv1, const int32_t* pages, int64_t len, int64_t page_size,
                          int64_t G, float scale) {
  static_assert(BLOCK == 16 && D % 16 == 0, "a block's scores are one vector");
  static const Halving hv;
  constexpr int C = D / 16;  // vectors per head row
  const int64_t h0 = kv0 * G, NH = (kv1 - kv0) * G;
  alignas(64) float acc[MAX_HEADS * D];
  float m[MAX_HEADS], l[MAX_HEADS];
  std::fill(acc, acc + NH * D, 0.f);
  std::fill(m, m + NH, -INFINITY);
  std::fill(l, l + NH, 0.f);
  const T *krow[BLOCK], *vrow[BLOCK];
  for (int64_t first = 0; first < len; first += BLOCK) {
    const int n = int(std::min(BLOCK, len - first));
    for (int j = 0; j < n; ++j) {
      krow[j] = token_row<T>(kc, pages, first + j, page_size);
      vrow[j] = token_row<T>(vc, pages, first + j, page_size);
    }
    const __mmask16 live = __mmask16((1u << n) - 1);
    // The next block's rows lie on other pages, anywhere in the pool: ask for them now, while this
    // block computes (measured: ~7% in bfloat16, where reading is a larger share of the time)
    const int64_t row_bytes = kc.head * (kv1 - kv0) * int64_t(sizeof(T));
    for (int64_t p = first + BLOCK; p < std::min(first + 2 * BLOCK, len); ++p) {
      const T* k = token_row<T>(kc, pages, p, page_size) + kv0 * kc.head;
      const T* v = token_row<T>(vc, pages, p, page_size) + kv0 * vc.head;
      for (int64_t b = 0; b < row_bytes; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k) + b, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v) + b, _MM_HINT_T0);
      }
    }
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      // The block's K and V rows of this head as float32, once for the G heads sharing them
      alignas(64) float kf[BLOCK * D], vf[BLOCK * D];
      for (int j = 0; j < n; ++j)
        for (int c = 0; c < C; ++c) {
          _mm512_store_ps(kf + j * D + c * 16, load16(krow[j] + kvh * kc.head + c * 16));
          _mm512_store_ps(vf + j * D + c * 16, load16(vrow[j] + kvh * vc.head + c * 16));
        }
      for (int64_t h = (kvh - kv0) * G; h < (kvh - kv0 + 1) * G; ++h) {
        __m512 qv[C], part[16];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_mul_ps(load16(q + (h0 + h) * D + c * 16),
                                                          _mm512_set1_ps(scale));
        for (int j = 0; j < 16; ++j) {  // scores: q . k of each key, as 16 lanes to be summed
          part[j] = _mm512_setzero_ps();
          if (j < n)
            for (int c = 0; c < C; ++c)
              part[j] = _mm512_fmadd_ps(qv[c], _mm512_load_ps(kf + j * D + c * 16), part[j]);
        }
        const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, sum_lanes(part, hv));
        const float block_max = std::max(m[h], _mm512_reduce_max_ps(s));
        const float correction = std::exp(m[h] - block_max);  // exp(-inf) = 0 at the first block
        const __m512 pv = _mm512_maskz_mov_ps(
            live, Vec(_mm512_sub_ps(s, _mm512_set1_ps(block_max))).exp_u20());
        alignas(64) float p[16];
        _mm512_store_ps(p, pv);
        l[h] = l[h] * correction + _mm512_reduce_add_ps(pv);
        m[h] = block_max;
        __m512 o[C];  // values: the head's output in registers for the whole block
        for (int c = 0; c < C; ++c)
          o[c] = _mm512_mul_ps(_mm512_load_ps(acc + h * D + c * 16), _mm512_set1_ps(correction));
        for (int j = 0; j < n; ++j) {
          const __m512 w = _mm512_set1_ps(p[j]);
          for (int c = 0; c < C; ++c)
            o[c] = _mm512_fmadd_ps(w, _mm512_load_ps(vf + j * D + c * 16), o[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_store_ps(acc + h * D + c * 16, o[c]);
      }
    }
  }
  write_out(out, acc, l, h0, NH, D, len);
}
#endif

// One request's heads [kv0, kv1): the AVX-512 pass where it applies, else the portable one.
template <typename T>
static void attend_any(const T* q, T* out, const Cache& kc, const Cache& vc, int64_t kv0,
                       int64_t kv1, const int32_t* pages, int64_t len, int64_t page_size,
                       int64_t G, int64_t D, float scale) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (D == 64)
      return attend_avx512<T, 64>(q, out, kc, vc, kv0, kv1, pages, len, page_size, G, scale);
    if (D == 128)
      return attend_avx512<T, 128>(q, out, kc, vc, kv0, kv1, pages, len, page_size, G, scale);
  }
#endif
  attend<T>(q, out, kc, vc, kv0, kv1, pages, len, page_size, G, D, scale);
}

static Cache cache_of(const torch::Tensor& cache) {
  return {cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2)};
}

template <typename T>
static void decode_all(const T* q, T* out, const Cache& kc, const Cache& vc, const int32_t* table,
                       int64_t pt_stride, const int32_t* rows, const int32_t* lens, int64_t B,
                       int64_t H, int64_t KVH, int64_t D, int64_t page_size, float scale) {
  const int64_t G = H / KVH, threads = at::get_num_threads();
  // A thread takes one request at a time (dynamic: they differ in length), all its heads in one
  // pass; with fewer requests than threads, a request's K/V heads go to different threads.
  const int64_t split = B < threads ? KVH : 1, heads = KVH / split;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < B * split; ++item) {
    const int64_t b = item / split, kv0 = (item % split) * heads;
    attend_any<T>(q + b * H * D, out + b * H * D, kc, vc, kv0, kv0 + heads,
              table + rows[b] * pt_stride, lens[b], page_size, G, D, scale);
  }
}

// q: [B, H, D]; k_cache, v_cache: [num_pages, page_size, KVH, D] -> out [B, H, D]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor page_table, torch::Tensor req_rows,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D]");
  for (const auto& cache : {k_cache, v_cache}) {
    TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 && cache.sizes() == k_cache.sizes(),
                "the caches must be [num_pages, page_size, KVH, D] with head_dim dense");
    TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "q and the caches must share a dtype");
  }
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && H <= MAX_HEADS && D == k_cache.size(3) && D <= MAX_HEAD_DIM,
              "unsupported heads / head_dim");
  TORCH_CHECK(page_table.scalar_type() == torch::kInt32 && page_table.stride(1) == 1 &&
                  req_rows.scalar_type() == torch::kInt32 && req_rows.is_contiguous() &&
                  seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "page_table, req_rows and seq_lens must be int32, rows contiguous");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    decode_all<scalar_t>(q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), cache_of(k_cache),
                         cache_of(v_cache), page_table.data_ptr<int32_t>(), page_table.stride(0),
                         req_rows.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), B, H, KVH,
                         D, k_cache.size(1), float(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "softmax(q k^T * scale) v over each request's cached keys, read through the page table");
}
