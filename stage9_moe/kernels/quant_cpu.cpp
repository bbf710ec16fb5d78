// Quantized matmul on a CPU (kernels/quant.py builds this file once with torch's C++ extension
// loader). A decode step (up to 16 rows) is a pass over the weights: `quant_gemv` reads each
// row's blocks once, straight from the layout they have in the GGUF file, and unpacks them in
// registers, 16 weights at a time:
//
//   q4_1  block = | d fp16 | m fp16 | 16 bytes |: weight j < 16 in byte j's low nibble, j + 16 in
//         its high nibble; w = q * d + m
//   q8_0  block = | d fp16 | 32 x int8 |: w = q * d
//   int8  row r = K x int8 and scale[r]: w = q * scale[r]
//
// It multiplies the integers q into x and applies a block's d and m once per block (below), so
// the result is the reference's (dequantize, then multiply) up to float32 rounding. Threads take
// ranges of output rows (at::parallel_for). `quant_dequantize` writes the float32 rows of a tile
// of the weight exactly as the reference does (a product, then a sum: two roundings, built with
// -ffp-contract=off), for products of more rows (quant.py hands those tiles to the float GEMM).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

enum Method : int64_t { Q4_1 = 0, Q8_0 = 1, INT8 = 2 };
constexpr int64_t BLOCK = 32;

static inline float half_at(const uint8_t* p) {  // a little-endian fp16 at p, as float32
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return float(c10::Half(bits, c10::Half::from_bits()));
}

static int64_t row_bytes(int64_t method, int64_t K) {
  return method == Q4_1 ? K / BLOCK * 20 : method == Q8_0 ? K / BLOCK * 34 : K;
}

// One weight row (K weights) dequantized into w[0..K): the reference's arithmetic.
static void dequantize_row(int64_t method, const uint8_t* row, float scale, int64_t K, float* w) {
  if (method == INT8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    for (int64_t k = 0; k < K; ++k) w[k] = float(q[k]) * scale;
    return;
  }
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    float* out = w + b * BLOCK;
    if (method == Q4_1) {
      const uint8_t* p = row + b * 20;
      const float d = half_at(p), m = half_at(p + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = float(p[4 + j] & 0x0F) * d + m;
        out[j + 16] = float(p[4 + j] >> 4) * d + m;
      }
    } else {
      const uint8_t* p = row + b * 34;
      const float d = half_at(p);
      for (int j = 0; j < 32; ++j) out[j] = float(int8_t(p[2 + j])) * d;
    }
  }
}

// A block's weights share d (and m), so a block's products need them once, not per weight:
//   sum_j (q_j * d + m) * x_j = d * sum_j q_j * x_j + m * sum_j x_j     (q4_1)
//   sum_j (q_j * d) * x_j     = d * sum_j q_j * x_j                     (q8_0)
// sum_j x_j of each block of x (xsum) is computed once per call, for all output rows. Equal in
// real arithmetic to summing the dequantized weights' products; in float32 the roundings differ
// (the kernel tests compare to the reference within 1e-5).

#if defined(CPU_CAPABILITY_AVX512)
// the two fp16 at p (a q4_1 block's d and m) in lanes 0 and 1, converted by the CPU (F16C)
static inline __m128 half2_at(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

// M rows of x (float, [M, K]) against one weight row: out[m] = sum_k w_k * x[m, k].
// Two accumulators per row of x (even and odd blocks): two independent chains of FMAs.
template <int M>
static inline void row_dot_avx512(int64_t method, const uint8_t* row, float scale, int64_t K,
                                  const float* x, const float* xsum, float* out) {
  const int64_t blocks = K / BLOCK;
  __m512 acc[2][M];
  float offset[M];  // q4_1: sum over blocks of m * xsum
  for (int m = 0; m < M; ++m) {
    acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    offset[m] = 0.f;
  }
  if (method == Q4_1) {
    const __m512i low4 = _mm512_set1_epi32(0x0F);
    auto block = [&](int64_t b, __m512* a) {
      const uint8_t* p = row + b * 20;
      const __m128 dm = half2_at(p);  // d, m
      const __m512 d = _mm512_broadcastss_ps(dm);
      const float mb = _mm_cvtss_f32(_mm_movehdup_ps(dm));
      // 16 bytes -> 16 int32 lanes; low nibbles are weights 0..15, high nibbles 16..31
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, low4));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * BLOCK;
        const __m512 qx = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16),
                                          _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
        a[m] = _mm512_fmadd_ps(qx, d, a[m]);
        offset[m] += mb * xsum[m * blocks + b];
      }
    };
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      block(b, acc[0]);
      block(b + 1, acc[1]);
    }
    if (b < blocks) block(b, acc[0]);
  } else if (method == Q8_0) {
    auto block = [&](int64_t b, __m512* a) {
      const uint8_t* p = row + b * 34;
      const __m512 d = _mm512_broadcastss_ps(half2_at(p));
      const __m512 q0 = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))));
      const __m512 q1 = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18))));
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * BLOCK;
        const __m512 qx = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16),
                                          _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
        a[m] = _mm512_fmadd_ps(qx, d, a[m]);
      }
    };
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      block(b, acc[0]);
      block(b + 1, acc[1]);
    }
    if (b < blocks) block(b, acc[0]);
  } else {  // int8: one scale per row, applied once at the end
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 q = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k))));
      for (int m = 0; m < M; ++m)
        acc[0][m] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x + m * K + k), acc[0][m]);
    }
    for (int m = 0; m < M; ++m) {  // the tail of a row not a multiple of 16
      float tail = 0.f;
      for (int64_t t = k; t < K; ++t) tail += float(int8_t(row[t])) * x[m * K + t];
      out[m] = (_mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m])) + tail) * scale;
    }
    return;
  }
  for (int m = 0; m < M; ++m)
    out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m])) + offset[m];
}
#endif

// The same sums one weight at a time (no AVX-512): out[m] = sum_k w_k * x[m, k].
[[maybe_unused]] static void row_dot_scalar(int64_t method, const uint8_t* row, float scale, int64_t K, int64_t M,
                           const float* x, const float* xsum, float* out) {
  const int64_t blocks = K / BLOCK;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float sum = 0.f;
    if (method == INT8) {
      for (int64_t k = 0; k < K; ++k) sum += float(int8_t(row[k])) * xm[k];
      out[m] = sum * scale;
      continue;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xm + b * BLOCK;
      float qx = 0.f;
      if (method == Q4_1) {
        const uint8_t* p = row + b * 20;
        for (int j = 0; j < 16; ++j)
          qx += float(p[4 + j] & 0x0F) * xb[j] + float(p[4 + j] >> 4) * xb[j + 16];
        sum += half_at(p) * qx + half_at(p + 2) * xsum[m * blocks + b];
      } else {
        const uint8_t* p = row + b * 34;
        for (int j = 0; j < 32; ++j) qx += float(int8_t(p[2 + j])) * xb[j];
        sum += half_at(p) * qx;
      }
    }
    out[m] = sum;
  }
}

constexpr int64_t GEMV_MAX_ROWS = 16;  // a decode batch; more rows: tiles and the float GEMM
constexpr int64_t ROWS_AT_ONCE = 4;    // rows of x each unpacked weight block is used for

// x [M, K] float32 (M <= 16), data [N, row bytes] uint8 or int8, scales [N] (int8) -> [M, N].
// Each weight row is unpacked once per 4 rows of x.
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor data, std::optional<torch::Tensor> scales,
                         std::optional<torch::Tensor> bias, int64_t method) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0);
  TORCH_CHECK(M >= 1 && M <= GEMV_MAX_ROWS, "quant_gemv takes 1 to ", GEMV_MAX_ROWS,
              " rows, got ", M);
  TORCH_CHECK(method == INT8 || K % BLOCK == 0, "K=", K, " is not a multiple of ", BLOCK);
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.size(1) == row_bytes(method, K),
              "data must be [N, ", row_bytes(method, K), "] bytes, got ", data.sizes());
  TORCH_CHECK(method != INT8 || (scales && scales->numel() == N &&
                                 scales->scalar_type() == torch::kFloat), "int8 needs scales [N]");
  TORCH_CHECK(!bias || (bias->numel() == N && bias->scalar_type() == torch::kFloat),
              "bias must be [N] float32");
  auto xc = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* dp = static_cast<const uint8_t*>(data.data_ptr());
  const float* sp = scales ? scales->data_ptr<float>() : nullptr;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t rb = row_bytes(method, K);
  // xsum [M, K / 32]: each block of x summed once, shared by every output row (q4_1's m term)
  const int64_t blocks = K / BLOCK;
  std::vector<float> xsum(method == Q4_1 ? M * blocks : 0, 0.f);
  for (int64_t m = 0; m < (xsum.empty() ? 0 : M); ++m)
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < BLOCK; ++j) xsum[m * blocks + b] += xp[m * K + b * BLOCK + j];
  const float* xs = xsum.data();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = dp + n * rb;
      const float scale = sp ? sp[n] : 1.f;
      float sums[GEMV_MAX_ROWS];
#if defined(CPU_CAPABILITY_AVX512)
      for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {
        const float* xm = xp + m0 * K;
        const float* xsm = xs + m0 * blocks;
        switch (std::min(M - m0, ROWS_AT_ONCE)) {
          case 1: row_dot_avx512<1>(method, row, scale, K, xm, xsm, sums + m0); break;
          case 2: row_dot_avx512<2>(method, row, scale, K, xm, xsm, sums + m0); break;
          case 3: row_dot_avx512<3>(method, row, scale, K, xm, xsm, sums + m0); break;
          default: row_dot_avx512<4>(method, row, scale, K, xm, xsm, sums + m0);
        }
      }
#else
      row_dot_scalar(method, row, scale, K, M, xp, xs, sums);
#endif
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = bp ? sums[m] + bp[n] : sums[m];
    }
  });
  return out;
}

// data [N, row bytes], scales [N] (int8) -> float32 [N, K]
torch::Tensor quant_dequantize(torch::Tensor data, std::optional<torch::Tensor> scales,
                               int64_t method, int64_t K) {
  const int64_t N = data.size(0), rb = row_bytes(method, K);
  TORCH_CHECK(method == INT8 || K % BLOCK == 0, "K=", K, " is not a multiple of ", BLOCK);
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.size(1) == rb,
              "data must be [N, ", rb, "] bytes, got ", data.sizes());
  TORCH_CHECK(method != INT8 || (scales && scales->numel() == N), "int8 needs scales [N]");
  auto out = torch::empty({N, K}, data.options().dtype(torch::kFloat));
  const uint8_t* dp = static_cast<const uint8_t*>(data.data_ptr());
  const float* sp = scales ? scales->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      dequantize_row(method, dp + n * rb, sp ? sp[n] : 1.f, K, op + n * K);
  });
  return out;
}

TORCH_LIBRARY(sglz_quant_cpu, m) {
  m.def("quant_gemv(Tensor x, Tensor data, Tensor? scales, Tensor? bias, int method) -> Tensor");
  m.def("quant_dequantize(Tensor data, Tensor? scales, int method, int K) -> Tensor");
}

TORCH_LIBRARY_IMPL(sglz_quant_cpu, CPU, m) {
  m.impl("quant_gemv", &quant_gemv);
  m.impl("quant_dequantize", &quant_dequantize);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
