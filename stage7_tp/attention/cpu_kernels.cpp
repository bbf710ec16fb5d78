// Attention that reads the paged KV cache in place, on a CPU (cpu_backend.py builds this file once
// with torch's C++ extension loader and calls it). One pass over a request's keys, the online
// softmax of flash-decoding, a block of BLOCK keys at a time, for every query head h (the G = H /
// KVH heads of one K/V head share its rows):
//
//     s[h, j] = scale * q[b, h] . k[slot(b, j)]                 scores of the block's keys
//     m'      = max(m, max_j s[h, j]);  acc, l *= exp(m - m')   a larger maximum rescales the past
//     p[h, j] = exp(s[h, j] - m');  l += sum_j p;  acc += sum_j p[h, j] * v[slot(b, j)]
//   out[b, h] = acc / l
//
// slot(b, j) = page_table[req_rows[b], j / page_size] * page_size + j % page_size: the same lookup
// as the torch backend's kv_indices, done while reading instead of copying the keys out first.
// Decode (paged_decode) has one query per request; prefill (paged_extend) runs the same pass for
// each new token of a prompt, over the keys up to itself, a few consecutive tokens per work item so
// that they share every key row they read. Threads take items one at a time (a request's K/V heads
// go to different threads when requests are fewer than threads). Arithmetic is float32 whatever
// the cache's dtype (bfloat16 rows are widened as they are read), in ATen's portable vectors
// (at::vec: AVX-512, AVX2, NEON... chosen when cpu_backend.py builds the file; SGLang's CPU kernels
// are written the same way). On AVX-512 with head_dim 64 or 128, attend_avx512 does the same pass
// in fewer instructions and with the memory ahead of it: a block's 16 scores summed as one vector,
// the outputs of several rows kept in registers while each value row is added into all of them,
// the next block's rows prefetched head by head, and with AVX512-BF16 a bfloat16 cache's scores
// taken from its bfloat16 rows by the dot-product instruction (stage 4's README, "CPU kernels, and
// bfloat16").
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
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

constexpr int64_t MAX_HEADS = 64;     // query heads (of this rank)
constexpr int64_t MAX_ROWS = 64;      // (query, head) rows of one work item
static_assert(MAX_ROWS >= MAX_HEADS, "a decode item is one query's heads");
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

// One work item for a thread: nq consecutive queries of one request (1 in decode; up to
// MAX_ROWS / H new tokens of a prompt in prefill), for its K/V heads [kv0, kv1). Query i sees the
// request's first len0 + i keys: itself and everything before it (causal).
template <typename T>
struct Item {
  const T* q;  // the first query's [H, D]; the others follow
  T* out;      // where its [H, D] output goes; the others follow
  int64_t nq, len0, kv0, kv1;
  const int32_t* pages;  // the request's row of the page table
};

// out[h0 + h] = acc[h] / l[h] for the NH heads of one query: the softmax's division, done once at
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

// The AVX-512 pass's rows, K/V head by K/V head: row r is query qi's head h, where
// r = (h / G - kv0) * nq * G + qi * G + h % G (the rows sharing a K/V head lie together).
struct Row {
  int64_t qi, h;
};
template <typename T>
static inline Row row_of(const Item<T>& it, int64_t r, int64_t G) {
  const int64_t per_kv = it.nq * G;
  return {(r % per_kv) / G, (it.kv0 + r / per_kv) * G + r % G};
}

// The AVX-512 pass's rows into their queries' outputs.
template <typename T>
static void write_rows(const Item<T>& it, const float* acc, const float* l, const int64_t* len,
                       int64_t H, int64_t G, int64_t D) {
  for (int64_t r = 0; r < (it.kv1 - it.kv0) * it.nq * G; ++r) {
    const Row row = row_of(it, r, G);
    write_out(it.out + row.qi * H * D, acc + r * D, l + r, row.h, 1, D, len[r]);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The same pass for head_dim D (a multiple of 16) on AVX-512, arranged so that nothing is
// reduced one lane at a time and independent work sits side by side: a block's 16 scores of a row
// come out as one vector (sum_lanes), and the outputs of NT rows sharing a K/V head stay in
// registers while each value row, read once, is added into all of them.
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
static const Halving halving;

// v[j] -> lane j: the sum of v[j]'s 16 lanes. Four halvings of pairs (15 adds, 30 permutes)
// instead of 16 separate horizontal sums.
static inline __m512 sum_lanes(__m512 v[16]) {
  for (int level = 0, count = 16; count > 1; ++level, count /= 2)
    for (int i = 0; i < count / 2; ++i)
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], halving.lo[level], v[2 * i + 1]),
                           _mm512_permutex2var_ps(v[2 * i], halving.hi[level], v[2 * i + 1]));
  return v[0];
}

// A bfloat16 cache on a CPU with AVX512-BF16 is read as it lies: a score is taken from the
// bfloat16 q and key rows with vdpbf16ps (the products of 32 bfloat16 pairs, exact in float32,
// added into 16 float32 lanes), and a value row is widened to float32 as it is added. Without
// AVX512-BF16, bfloat16 rows are widened to float32 once per block (block_rows) and everything is
// float32 FMAs, as for a float32 cache. S: the type the pass reads q, key and value rows as.
#if defined(__AVX512BF16__)
template <typename T>
constexpr bool DOT_BF16 = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool DOT_BF16 = false;
#endif
template <typename T>
using RowType = std::conditional_t<DOT_BF16<T>, T, float>;

// Inlined whatever the compiler's size heuristics say: called, the pass kept part[] in memory and
// ran ~15% slower (prefill, float32 and bfloat16).
#define ALWAYS_INLINE __attribute__((always_inline))

// Row q's dot products with the block's first live_n keys, key j's as 16 lanes still to be summed
// (sum_lanes); q is float32 and scaled, or (below) bfloat16 and not.
template <int C>
ALWAYS_INLINE static inline void partial_scores(const float* q, const float* const* k,
                                                int live_n, __m512 part[16]) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_load_ps(q + c * 16);
  for (int j = 0; j < 16; ++j) {
    part[j] = _mm512_setzero_ps();
    if (j < live_n)
      for (int c = 0; c < C; ++c) part[j] = _mm512_fmadd_ps(qv[c], load16(k[j] + c * 16), part[j]);
  }
}
#if defined(__AVX512BF16__)
template <int C>
ALWAYS_INLINE static inline void partial_scores(const c10::BFloat16* q,
                                                const c10::BFloat16* const* k, int live_n,
                                                __m512 part[16]) {
  __m512bh qv[C / 2];  // 32 bfloat16 a vector
  for (int c = 0; c < C / 2; ++c) qv[c] = (__m512bh)_mm512_load_si512(q + c * 32);
  for (int j = 0; j < 16; ++j) {
    part[j] = _mm512_setzero_ps();
    if (j < live_n)
      for (int c = 0; c < C / 2; ++c)
        part[j] = _mm512_dpbf16_ps(part[j], qv[c], (__m512bh)_mm512_loadu_si512(k[j] + c * 32));
  }
}
#endif

// A block's K (V) rows of one head as the pass reads them (RowType): where they lie, or bfloat16
// widened once into buf for every row of the item that reads them.
template <typename T, int D>
static inline void block_rows(const T* const* krow, const T* const* vrow, int64_t khead,
                              int64_t vhead, int n, float* kbuf, float* vbuf,
                              const RowType<T>** kp, const RowType<T>** vp) {
  for (int j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<RowType<T>, T>) {
      kp[j] = krow[j] + khead;
      vp[j] = vrow[j] + vhead;
    } else {
      for (int c = 0; c < D / 16; ++c) {
        _mm512_store_ps(kbuf + j * D + c * 16, load16(krow[j] + khead + c * 16));
        _mm512_store_ps(vbuf + j * D + c * 16, load16(vrow[j] + vhead + c * 16));
      }
      kp[j] = kbuf + j * D;
      vp[j] = vbuf + j * D;
    }
  }
}

template <typename T, int D>
static void attend_avx512(const Item<T>& it, const Cache& kc, const Cache& vc, int64_t H,
                          int64_t G, int64_t page_size, float scale) {
  static_assert(BLOCK == 16 && D % 16 == 0, "a block's scores are one vector");
  constexpr int C = D / 16;              // vectors per head row
  constexpr int NT = C <= 4 ? 4 : 2;     // rows in registers together: NT * C <= 16 accumulators
  using S = RowType<T>;
  const int64_t per_kv = it.nq * G, R = (it.kv1 - it.kv0) * per_kv;
  // Row r (row_of): its query (float32 scaled, or bfloat16 as it is: its scores are scaled), its
  // output so far, the online softmax's maximum and sum, its number of keys.
  alignas(64) S qs[MAX_ROWS * D];
  alignas(64) float acc[MAX_ROWS * D];
  float m[MAX_ROWS], l[MAX_ROWS];
  int64_t len[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const Row row = row_of(it, r, G);
    const T* q = it.q + row.qi * H * D + row.h * D;
    if constexpr (DOT_BF16<T>)
      std::copy(q, q + D, qs + r * D);
    else
      for (int c = 0; c < C; ++c)
        _mm512_store_ps(qs + r * D + c * 16,
                        _mm512_mul_ps(load16(q + c * 16), _mm512_set1_ps(scale)));
    len[r] = it.len0 + row.qi;
  }
  std::fill(acc, acc + R * D, 0.f);
  std::fill(m, m + R, -INFINITY);
  std::fill(l, l + R, 0.f);
  const int64_t max_len = it.len0 + it.nq - 1;
  const T *krow[BLOCK], *vrow[BLOCK];
  alignas(64) float kbuf[BLOCK * D], vbuf[BLOCK * D];
  const S *kp[BLOCK], *vp[BLOCK];
  for (int64_t first = 0; first < max_len; first += BLOCK) {
    const int n = int(std::min(BLOCK, max_len - first));
    for (int j = 0; j < n; ++j) {
      krow[j] = token_row<T>(kc, it.pages, first + j, page_size);
      vrow[j] = token_row<T>(vc, it.pages, first + j, page_size);
    }
    for (int64_t kvh = it.kv0; kvh < it.kv1; ++kvh) {
      // The next block's rows of this head lie on other pages, anywhere in the pool: ask for them
      // while this head's rows compute. A head at a time, spread over the block's work: asking
      // for every head's rows at once queued more misses than the core tracks, and measured
      // slower (PERFORMANCE.md, "The CPU kernels and bfloat16": 496 -> 392 / 298 -> 220 us).
      // Into L2 (T1), not L1 (T0): a block's 64 lines are more than L1 tracks in flight; decode
      // of 60 requests (`python -m common.bench cpu-attention --batch 60`): 592 -> 416 us in
      // bfloat16, 998 -> 775 us in float32.
      for (int64_t p = first + BLOCK; p < std::min(first + 2 * BLOCK, max_len); ++p) {
        const T* k = token_row<T>(kc, it.pages, p, page_size) + kvh * kc.head;
        const T* v = token_row<T>(vc, it.pages, p, page_size) + kvh * vc.head;
        for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(k) + b, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(v) + b, _MM_HINT_T1);
        }
      }
      block_rows<T, D>(krow, vrow, kvh * kc.head, kvh * vc.head, n, kbuf, vbuf, kp, vp);
      const int64_t r_end = (kvh - it.kv0 + 1) * per_kv;
      for (int64_t r0 = (kvh - it.kv0) * per_kv; r0 < r_end; r0 += NT) {
        const int nt = int(std::min<int64_t>(NT, r_end - r0));
        alignas(64) float p[NT][16];
        float correction[NT];
        for (int t = 0; t < NT; ++t) {  // scores and softmax of each row, independent chains
          if (t >= nt) break;
          const int64_t r = r0 + t;
          const int live_n = int(std::clamp<int64_t>(len[r] - first, 0, n));
          if (live_n == 0) {  // a prefill query whose keys all lie before this block
            _mm512_store_ps(p[t], _mm512_setzero_ps());
            correction[t] = 1.f;
            continue;
          }
          __m512 part[16];
          partial_scores<C>(qs + r * D, kp, live_n, part);
          __m512 summed = sum_lanes(part);
          if constexpr (DOT_BF16<T>) summed = _mm512_mul_ps(summed, _mm512_set1_ps(scale));
          const __mmask16 live = __mmask16((1u << live_n) - 1);
          const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, summed);
          const float block_max = std::max(m[r], _mm512_reduce_max_ps(s));
          correction[t] = std::exp(m[r] - block_max);  // exp(-inf) = 0 at the first block
          const __m512 pv = _mm512_maskz_mov_ps(
              live, Vec(_mm512_sub_ps(s, _mm512_set1_ps(block_max))).exp_u20());
          _mm512_store_ps(p[t], pv);
          l[r] = l[r] * correction[t] + _mm512_reduce_add_ps(pv);
          m[r] = block_max;
        }
        __m512 o[NT][C];  // values: NT rows' outputs in registers, each value row read once
        for (int t = 0; t < NT; ++t)
          if (t < nt)
            for (int c = 0; c < C; ++c)
              o[t][c] = _mm512_mul_ps(_mm512_load_ps(acc + (r0 + t) * D + c * 16),
                                      _mm512_set1_ps(correction[t]));
        for (int j = 0; j < n; ++j) {
          __m512 v[C];
          for (int c = 0; c < C; ++c) v[c] = load16(vp[j] + c * 16);
          for (int t = 0; t < NT; ++t)
            if (t < nt) {
              const __m512 w = _mm512_set1_ps(p[t][j]);
              for (int c = 0; c < C; ++c) o[t][c] = _mm512_fmadd_ps(w, v[c], o[t][c]);
            }
        }
        for (int t = 0; t < NT; ++t)
          if (t < nt)
            for (int c = 0; c < C; ++c) _mm512_store_ps(acc + (r0 + t) * D + c * 16, o[t][c]);
      }
    }
  }
  write_rows(it, acc, l, len, H, G, D);
}
#endif

// One item: the AVX-512 pass where it applies, else the portable one, query by query.
template <typename T>
static void attend_item(const Item<T>& it, const Cache& kc, const Cache& vc, int64_t H,
                        int64_t G, int64_t D, int64_t page_size, float scale) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (D == 64) return attend_avx512<T, 64>(it, kc, vc, H, G, page_size, scale);
    if (D == 128) return attend_avx512<T, 128>(it, kc, vc, H, G, page_size, scale);
  }
#endif
  for (int64_t i = 0; i < it.nq; ++i)
    attend<T>(it.q + i * H * D, it.out + i * H * D, kc, vc, it.kv0, it.kv1, it.pages, it.len0 + i,
              page_size, G, D, scale);
}

template <typename T>
static void attend_all(const std::vector<Item<T>>& items, const Cache& kc, const Cache& vc,
                       int64_t H, int64_t KVH, int64_t D, int64_t page_size, float scale) {
  const int64_t n = int64_t(items.size());
  // dynamic: items differ in length
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < n; ++i)
    attend_item<T>(items[i], kc, vc, H, H / KVH, D, page_size, scale);
}

static Cache cache_of(const torch::Tensor& cache) {
  return {cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2)};
}

static void check_args(const torch::Tensor& q, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& page_table,
                       const std::vector<torch::Tensor>& int_vectors) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [N, H, D]");
  for (const auto& cache : {k_cache, v_cache}) {
    TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 && cache.sizes() == k_cache.sizes(),
                "the caches must be [num_pages, page_size, KVH, D] with head_dim dense");
    TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "q and the caches must share a dtype");
  }
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && H <= MAX_HEADS && D == k_cache.size(3) && D <= MAX_HEAD_DIM,
              "unsupported heads / head_dim");
  TORCH_CHECK(page_table.scalar_type() == torch::kInt32 && page_table.stride(1) == 1,
              "page_table must be int32 with contiguous rows");
  for (const auto& v : int_vectors)
    TORCH_CHECK(v.scalar_type() == torch::kInt32 && v.is_contiguous() && v.device().is_cpu(),
                "req_rows, seq_lens and cu_seqlens must be contiguous int32 CPU tensors");
}

template <typename T>
static torch::Tensor run(const torch::Tensor& q, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const std::vector<Item<T>>& items,
                         torch::Tensor out, double scale) {
  attend_all<T>(items, cache_of(k_cache), cache_of(v_cache), q.size(1), k_cache.size(2),
                q.size(2), k_cache.size(1), float(scale));
  return out;
}

// Decode. q: [B, H, D], one query per request; k_cache, v_cache: [num_pages, page_size, KVH, D]
// -> out [B, H, D]. Request b sees its first seq_lens[b] keys.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor page_table, torch::Tensor req_rows,
                           torch::Tensor seq_lens, double scale) {
  check_args(q, k_cache, v_cache, page_table, {req_rows, seq_lens});
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  const int32_t *rows = req_rows.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  auto out = torch::empty_like(q);
  // A thread takes one request at a time, all its heads in one pass; with fewer requests than
  // threads, a request's K/V heads go to different threads.
  const int64_t split = B < at::get_num_threads() ? KVH : 1, heads = KVH / split;
  return AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    std::vector<Item<scalar_t>> items;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < split; ++s)
        items.push_back({q.data_ptr<scalar_t>() + b * H * D, out.data_ptr<scalar_t>() + b * H * D,
                         1, lens[b], s * heads, (s + 1) * heads,
                         page_table.data_ptr<int32_t>() + rows[b] * page_table.stride(0)});
    return run<scalar_t>(q, k_cache, v_cache, items, out, scale);
  });
}

// Prefill (an extend): q: [N, H, D], the new tokens of B requests packed, request b's at
// [cu_seqlens[b], cu_seqlens[b + 1]); their K/V already stored in the cache. Request b's new
// tokens are the last of its seq_lens[b] keys, and each sees the keys up to itself.
torch::Tensor paged_extend(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor page_table, torch::Tensor req_rows,
                           torch::Tensor cu_seqlens, torch::Tensor seq_lens, double scale) {
  check_args(q, k_cache, v_cache, page_table, {req_rows, cu_seqlens, seq_lens});
  const int64_t B = req_rows.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(cu_seqlens.size(0) == B + 1 && seq_lens.size(0) == B, "one entry per request");
  const int32_t *rows = req_rows.data_ptr<int32_t>(), *cu = cu_seqlens.data_ptr<int32_t>(),
                *lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(cu[B] == q.size(0), "cu_seqlens must end at the number of queries");
  auto out = torch::empty_like(q);
  // Up to MAX_ROWS / H consecutive queries per item: they share the keys they read.
  const int64_t per_item = std::max<int64_t>(1, MAX_ROWS / H), KVH = k_cache.size(2);
  return AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_extend", [&] {
    std::vector<Item<scalar_t>> items;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t new_tokens = cu[b + 1] - cu[b], prefix = lens[b] - new_tokens;
      TORCH_CHECK(new_tokens >= 0 && prefix >= 0, "request ", b, ": seq_len below its new tokens");
      for (int64_t i = 0; i < new_tokens; i += per_item) {
        const int64_t offset = (cu[b] + i) * H * D;
        items.push_back({q.data_ptr<scalar_t>() + offset, out.data_ptr<scalar_t>() + offset,
                         std::min(per_item, new_tokens - i), prefix + i + 1, 0, KVH,
                         page_table.data_ptr<int32_t>() + rows[b] * page_table.stride(0)});
      }
    }
    return run<scalar_t>(q, k_cache, v_cache, items, out, scale);
  });
}

// ---------------------------------------------------------------- the KV store (kv_cache.py)
// k_cache, v_cache: one layer's [num_pages, page_size, KVH, D]; k, v: [N, KVH, D] (views of the
// qkv product: any strides with D dense) -> row n written at token slot out_cache_loc[n]. What
// kv_cache._store_kv's two index assignments do; other layouts go through those.
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor out_cache_loc) {
  const auto fits = [](const torch::Tensor& rows, const torch::Tensor& cache) {
    return rows.scalar_type() == cache.scalar_type() && cache.is_contiguous() && rows.dim() == 3 &&
           rows.stride(2) == 1 && cache.size(-2) == rows.size(1) && cache.size(-1) == rows.size(2);
  };
  if (!fits(k, k_cache) || !fits(v, v_cache) || k_cache.sizes() != v_cache.sizes() ||
      k.size(0) != v.size(0) || out_cache_loc.scalar_type() != torch::kLong ||
      !out_cache_loc.is_contiguous()) {
    k_cache.view({-1, k.size(1), k.size(2)}).index_put_({out_cache_loc}, k);
    v_cache.view({-1, v.size(1), v.size(2)}).index_put_({out_cache_loc}, v);
    return;
  }
  const int64_t N = k.size(0), KVH = k.size(1), slots = k_cache.numel() / (KVH * k.size(2));
  const int64_t* loc = out_cache_loc.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)  // all checked before anything is written
    TORCH_CHECK(loc[n] >= 0 && loc[n] < slots, "out_cache_loc[", n, "] = ", loc[n],
                " is outside the cache's ", slots, " slots");
  // row n of `rows` ([KVH, D], D dense) to slot loc[n] of `cache`, one head's D values at a time
  const auto write = [&](const torch::Tensor& rows, torch::Tensor& cache) {
    const int64_t es = rows.element_size(), bytes = rows.size(2) * es;
    char* dst = static_cast<char*>(cache.data_ptr());
    const char* src = static_cast<const char*>(rows.data_ptr());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < KVH; ++h)
        std::memcpy(dst + (loc[n] * KVH + h) * bytes,
                    src + (n * rows.stride(0) + h * rows.stride(1)) * es, bytes);
  };
  write(k, k_cache);
  write(v, v_cache);
}

// ---------------------------------------------------------------- as the operators' CPU kernels
// cpu_backend.py and kv_cache.py define the operators, each stage package in its own namespace
// (stage5_cudagraph::paged_decode_attention, ...), with a Python function as their kernel: a
// call from stage 5's compiled decode then goes from C++ back into Python and out again, ~10 us a
// call, for each of the three operators, every layer of every step. register_ops gives them these
// C++ functions as their kernels for CPU tensors; the Python ones stay for the first call, which
// builds this file.
static torch::Tensor decode_op(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor page_table, torch::Tensor req_rows,
                               torch::Tensor seq_lens, double scale) {
  return paged_decode(q.contiguous(), k_cache, v_cache, page_table, req_rows, seq_lens, scale);
}

static torch::Tensor extend_op(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor page_table, torch::Tensor req_rows,
                               torch::Tensor cu_seqlens, torch::Tensor seq_lens, double scale) {
  return paged_extend(q.contiguous(), k_cache, v_cache, page_table, req_rows, cu_seqlens,
                      seq_lens, scale);
}

static std::vector<std::unique_ptr<torch::Library>> registered;  // kept: dropping one unregisters

void register_ops(const std::string& ns) {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU,
                                              __FILE__, __LINE__);
  lib->impl("paged_decode_attention", TORCH_FN(decode_op));
  lib->impl("paged_extend_attention", TORCH_FN(extend_op));
  lib->impl("store_kv", TORCH_FN(store_kv));
  registered.push_back(std::move(lib));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "softmax(q k^T * scale) v over each request's cached keys, read through the page table");
  m.def("paged_extend", &paged_extend,
        "causal attention of each request's new tokens over its cached keys, through the page table");
  m.def("store_kv", &store_kv, "write k and v at their token slots in one layer's caches");
  m.def("register_ops", &register_ops,
        "make these the CPU kernels of the operators of the namespace (a stage package)");
}
