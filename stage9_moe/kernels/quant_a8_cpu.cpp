// q4_1 / q8_0 weights times activations rounded to int8 (kernels/quant_a8.py builds this file).
// What llama.cpp does for these files: its Q4_1 x Q8_1 and Q8_0 x Q8_0 dots. Each block of 32
// values of a row of x becomes 32 int8 and one float scale,
//
//   dx = max|x_j| / 127,   xq_j = round(x_j * (1 / dx))          (round half to even)
//
// and a block's product is integer arithmetic plus two float multiplies:
//
//   q4_1: sum_j (q_j d + m) (xq_j dx) = (d dx) * sum_j q_j xq_j  +  m * (dx sum_j xq_j)
//   q8_0: sum_j (q_j d) (xq_j dx)     = (d dx) * sum_j q_j xq_j
//
// The integer sums are exact. With AVX512-VNNI one instruction (vpdpbusd) multiplies 32 pairs of
// bytes and adds them in fours into 8 int32: a 32-weight block is about a dozen instructions,
// against about twice that for the float gemv of quant_cpu.cpp, which at batch 1 on a small CPU
// is bound by instructions, not by the bytes it reads. Lossy: x loses bits (quant_a8.py's torch
// reference computes the same rounding; tests/test_stage9_quant.py measures the tokens kept).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SGLZ_VNNI 1
#endif

enum Method : int64_t { Q4_1 = 0, Q8_0 = 1 };
constexpr int64_t BLOCK = 32, MAX_ROWS = 16, ROWS_AT_ONCE = 4;

static inline float half_at(const uint8_t* p) {  // a little-endian fp16 at p, as float32
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return float(c10::Half(bits, c10::Half::from_bits()));
}

// One row of x (K floats) -> K int8 q, and per block b its scale d and s = d * sum(q), side by
// side: meta[2 b] = d, meta[2 b + 1] = s.
static void quantize_row(const float* x, int64_t K, int8_t* q, float* meta) {
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    float amax = 0.f;
    for (int j = 0; j < BLOCK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.f, inv = db > 0.f ? 1.f / db : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < BLOCK; ++j) {
      const int32_t v = int32_t(std::nearbyint(xb[j] * inv));
      q[b * BLOCK + j] = int8_t(v);
      sum += v;
    }
    meta[2 * b] = db;
    meta[2 * b + 1] = db * float(sum);
  }
}

struct X8 {  // M rows of x, quantized
  const int8_t* q;      // [M, K]
  const int8_t* pairs;  // [M, K]: q in the order q4_1_pair unpacks two blocks' weights
  const float* meta;    // [M, blocks, 2]: d and s of each block, side by side
  int64_t K, blocks;
  float d(int64_t xb) const { return meta[2 * xb]; }
  float s(int64_t xb) const { return meta[2 * xb + 1]; }
};

// A pair of blocks b, b+1 of q in q4_1_pair's order: b[0:16], b+1[0:16], b[16:32], b+1[16:32].
static void pair_order(const int8_t* q, int64_t blocks, int8_t* out) {
  for (int64_t b = 0; b + 2 <= blocks; b += 2)
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 2; ++k)
        std::memcpy(out + b * BLOCK + h * 32 + k * 16, q + (b + k) * BLOCK + h * 16, 16);
}

// One block's product in integers (no VNNI; and the odd last block of the q4_1 pairs):
// row's block b times block b of x's row r (xb = r * blocks + b).
static float block_dot(int64_t method, const uint8_t* row, const X8& x, int64_t r, int64_t b) {
  const int64_t xb = r * x.blocks + b;
  const int8_t* xq = x.q + xb * BLOCK;
  int32_t isum = 0;
  if (method == Q4_1) {
    const uint8_t* p = row + b * 20;
    for (int j = 0; j < 16; ++j)
      isum += int32_t(p[4 + j] & 0x0F) * xq[j] + int32_t(p[4 + j] >> 4) * xq[j + 16];
    return half_at(p) * x.d(xb) * float(isum) + half_at(p + 2) * x.s(xb);
  }
  const uint8_t* p = row + b * 34;
  for (int j = 0; j < 32; ++j) isum += int32_t(int8_t(p[2 + j])) * xq[j];
  return half_at(p) * x.d(xb) * float(isum);
}

#if defined(SGLZ_VNNI)
static inline float half_f16c(const uint8_t* p) {  // half_at, converted by the CPU (F16C)
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// q4_1, two blocks at a time in 512-bit registers: 64 weights as
// [b low nibbles | b+1 low nibbles | b high nibbles | b+1 high nibbles] (x in pair_order's order)
static inline __m512i q4_1_pair(const uint8_t* p) {  // block b at p, b+1 at p + 20
  const __m256i nibbles = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 24)), 1);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles),
                                          _mm256_srli_epi16(nibbles, 4), 1);
  return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
}

static inline int32_t bytes4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The d and m of `count` (2 or 4) blocks from p on, by F16C: [d_b, m_b, d_b+1, m_b+1, ...]
static inline __m256 q4_1_dm(const uint8_t* p, int count) {
  __m128i halves = _mm_insert_epi32(_mm_cvtsi32_si128(bytes4(p)), bytes4(p + 20), 1);
  if (count == 4)
    halves = _mm_insert_epi32(_mm_insert_epi32(halves, bytes4(p + 40), 2), bytes4(p + 60), 3);
  return _mm256_cvtph_ps(halves);
}

// M rows of x against one q4_1 weight row, four blocks (two pairs) a step. Per pair: one vpdpbusd
// (64 products into 16 int32: lanes 0-3 and 8-11 are the first block's, 4-7 and 12-15 the
// second's), each lane scaled by its block's d * dx. The scales of four blocks come from one
// conversion and one multiply; their m * s terms add up in the odd lanes of `offset`.
template <int M>
static void row_dot_q4_1(const uint8_t* row, const X8& x, int64_t m0, float* out) {
  const __m512i first_pair = _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i second_pair = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 6, 6, 6, 6, 4, 4, 4, 4);
  __m512 acc[2][M];
  __m256 offset[M];
  for (int m = 0; m < M; ++m) {
    acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    offset[m] = _mm256_setzero_ps();
  }
  // blocks b .. b + 2 * pairs - 1 (pairs: 1 or 2)
  auto step = [&](int64_t b, int pairs) {
    const uint8_t* p = row + b * 20;
    const __m256 dm = q4_1_dm(p, 2 * pairs);
    const __m512i w0 = q4_1_pair(p);
    const __m512i w1 = pairs == 2 ? q4_1_pair(p + 40) : w0;
    for (int m = 0; m < M; ++m) {
      const int64_t xb = (m0 + m) * x.blocks + b;
      const __m256 meta = pairs == 2 ? _mm256_loadu_ps(x.meta + 2 * xb)
                                     : _mm256_zextps128_ps256(_mm_loadu_ps(x.meta + 2 * xb));
      const __m256 scales = _mm256_mul_ps(dm, meta);  // d dx, m s, d dx, m s, ...
      const __m256 used = pairs == 2 ? scales  // one pair: the upper lanes hold no block
                                     : _mm256_zextps128_ps256(_mm256_castps256_ps128(scales));
      offset[m] = _mm256_add_ps(offset[m], used);
      const __m512 wide = _mm512_castps256_ps512(scales);
      const __m512i x0 = _mm512_loadu_si512(x.pairs + xb * BLOCK);
      acc[0][m] = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, x0)),
          _mm512_permutexvar_ps(first_pair, wide), acc[0][m]);
      if (pairs == 2) {
        const __m512i x1 = _mm512_loadu_si512(x.pairs + (xb + 2) * BLOCK);
        acc[1][m] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, x1)),
            _mm512_permutexvar_ps(second_pair, wide), acc[1][m]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 4 <= x.blocks; b += 4) step(b, 2);
  if (b + 2 <= x.blocks) step(b, 1), b += 2;
  for (int m = 0; m < M; ++m) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, offset[m]);
    const float tail = b < x.blocks ? block_dot(Q4_1, row, x, m0 + m, b) : 0.f;  // odd last block
    const float products = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
    out[m] = products + ((lanes[1] + lanes[3]) + (lanes[5] + lanes[7])) + tail;
  }
}

// M rows of x against one q8_0 weight row, a block at a time (256-bit). vpdpbusd takes unsigned
// x signed bytes: |w| times x with w's sign. Even and odd blocks add into two accumulators.
template <int M>
static void row_dot_q8_0(const uint8_t* row, const X8& x, int64_t m0, float* out) {
  __m256 acc[2][M];
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256* a) {
    const uint8_t* p = row + b * 34;
    const float d = half_f16c(p);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    const __m256i w_abs = _mm256_abs_epi8(w);
    for (int m = 0; m < M; ++m) {
      const int64_t xb = (m0 + m) * x.blocks + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + xb * BLOCK));
      const __m256i isum =
          _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, _mm256_sign_epi8(xq, w));
      a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * x.d(xb)), a[m]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= x.blocks; b += 2) {
    block(b, acc[0]);
    block(b + 1, acc[1]);
  }
  if (b < x.blocks) block(b, acc[0]);
  for (int m = 0; m < M; ++m) {
    const __m256 v = _mm256_add_ps(acc[0][m], acc[1][m]);
    out[m] = _mm512_reduce_add_ps(_mm512_castps256_ps512(v));
  }
}

template <int M>
static void row_dot(int64_t method, const uint8_t* row, const X8& x, int64_t m0, float* out) {
  if (method == Q4_1) row_dot_q4_1<M>(row, x, m0, out);
  else row_dot_q8_0<M>(row, x, m0, out);
}
#endif

// x [M, K] float32 (M <= 16), data [N, row bytes] uint8 -> [M, N] float32
torch::Tensor quant_gemv_a8(torch::Tensor x, torch::Tensor data, std::optional<torch::Tensor> bias,
                            int64_t method) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(method == Q4_1 || method == Q8_0, "int8 activations need q4_1 or q8_0 blocks");
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0), blocks = K / BLOCK;
  const int64_t rb = blocks * (method == Q4_1 ? 20 : 34);
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "quant_gemv_a8 takes 1 to ", MAX_ROWS, " rows, got ", M);
  TORCH_CHECK(K % BLOCK == 0, "K=", K, " is not a multiple of ", BLOCK);
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.size(1) == rb,
              "data must be [N, ", rb, "] bytes, got ", data.sizes());
  TORCH_CHECK(!bias || (bias->numel() == N && bias->scalar_type() == torch::kFloat),
              "bias must be [N] float32");
  auto xc = x.contiguous();
  std::vector<int8_t> q(M * K), pairs(method == Q4_1 ? M * K : 0);
  std::vector<float> meta(2 * M * blocks);
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(xc.data_ptr<float>() + m * K, K, q.data() + m * K, meta.data() + 2 * m * blocks);
    if (!pairs.empty()) pair_order(q.data() + m * K, blocks, pairs.data() + m * K);
  }
  const X8 x8{q.data(), pairs.data(), meta.data(), K, blocks};
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* dp = static_cast<const uint8_t*>(data.data_ptr());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = dp + n * rb;
      float sums[MAX_ROWS];
      for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {
#if defined(SGLZ_VNNI)
        switch (std::min(M - m0, ROWS_AT_ONCE)) {
          case 1: row_dot<1>(method, row, x8, m0, sums + m0); break;
          case 2: row_dot<2>(method, row, x8, m0, sums + m0); break;
          case 3: row_dot<3>(method, row, x8, m0, sums + m0); break;
          default: row_dot<4>(method, row, x8, m0, sums + m0);
        }
#else
        for (int64_t m = m0; m < std::min(M, m0 + ROWS_AT_ONCE); ++m) {
          sums[m] = 0.f;
          for (int64_t b = 0; b < blocks; ++b) sums[m] += block_dot(method, row, x8, m, b);
        }
#endif
      }
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = bp ? sums[m] + bp[n] : sums[m];
    }
  });
  return out;
}

// x [M, K] float32 -> xq * dx per block of 32, the values the gemv multiplies: what the paths for
// more rows multiply instead of x (quant_a8.py's round_activations, in one pass over x).
torch::Tensor round_a8(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) % BLOCK == 0,
              "x must be [M, K] float32 with K a multiple of ", BLOCK);
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t M = xc.size(0), K = xc.size(1), blocks = K / BLOCK;
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> q(K);
    std::vector<float> meta(2 * blocks);
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(xp + m * K, K, q.data(), meta.data());
      for (int64_t k = 0; k < K; ++k) op[m * K + k] = float(q[k]) * meta[2 * (k / BLOCK)];
    }
  });
  return out;
}

TORCH_LIBRARY(sglz_quant_a8_cpu, m) {
  m.def("quant_gemv_a8(Tensor x, Tensor data, Tensor? bias, int method) -> Tensor");
  m.def("round_a8(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(sglz_quant_a8_cpu, CPU, m) {
  m.impl("quant_gemv_a8", &quant_gemv_a8);
  m.impl("round_a8", &round_a8);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
