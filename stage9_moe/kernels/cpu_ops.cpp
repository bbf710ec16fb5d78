// The four elementwise kernels of kernels/__init__.py for CPU tensors (kernels/cpu.py builds this
// file once with torch's C++ extension loader). What they save on a CPU is not arithmetic but
// passes and calls: the torch versions (native.py) run each norm as ~7 operators and RoPE as ~12,
// each a pass over the rows and a trip through torch's dispatcher; here each is one call and one
// pass over each row, threads taking rows. Arithmetic is float32 whatever the tensors' dtype,
// rounded to it where the torch versions round (so bfloat16 results match theirs op for op), and
// built with -ffp-contract=off: a * b + c stays two roundings, as in torch, not one fused FMA.
// Vectorized<float> (ATen's portable vectors) where a row's work is a reduction or a
// transcendental: the same exp / cos / sin torch's own CPU kernels call. Then `gemv`, the matmul
// of a decode step of one or two rows (layers.linear), whose FMAs are explicit.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

template <typename T>
static inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}

template <typename T>
static inline float rounded(float x) {  // x as the tensor's dtype would hold it
  return float(T(x));
}

// out[r] = w * T(x[r] / sqrt(mean(x[r]^2) + eps)); with res: first x[r] = T(x[r] + res[r]),
// written to res_out[r] (the residual stream after the add).
template <typename T>
static void rmsnorm_rows(const torch::Tensor& x, const torch::Tensor& res, torch::Tensor& res_out,
                         const torch::Tensor& weight, torch::Tensor& out, double eps) {
  const int64_t N = x.size(0), D = x.size(1);
  const T *xp = x.data_ptr<T>(), *rp = res.defined() ? res.data_ptr<T>() : nullptr;
  T *op = out.data_ptr<T>(), *rop = res_out.defined() ? res_out.data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = res.defined() ? res.stride(0) : 0;
  std::vector<float> w(D);
  to_float(weight.data_ptr<T>(), w.data(), D);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t r = begin; r < end; ++r) {
      to_float(xp + r * xs, row.data(), D);
      if (rp) {
        for (int64_t i = 0; i < D; ++i) {
          row[i] = rounded<T>(row[i] + float(rp[r * rs + i]));
          rop[r * D + i] = T(row[i]);
        }
      }
      Vec sum(0.f);
      int64_t i = 0;
      for (; i + Vec::size() <= D; i += Vec::size()) {
        const Vec v = Vec::loadu(row.data() + i);
        sum = sum + v * v;
      }
      float ss = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, sum);
      for (; i < D; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / float(D) + float(eps));
      for (int64_t d = 0; d < D; ++d) op[r * D + d] = T(w[d] * rounded<T>(row[d] * inv));
    }
  });
}

static void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              name, " must be a CPU [rows, dim] tensor with dim dense");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              name, " must be float32 or bfloat16");
}

static void check_weight(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(), "weight must be x's [D], its dtype");
}

// x [N, D], weight [D] -> rmsnorm(x) [N, D]
torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_weight(x, weight);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  torch::Tensor none;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rmsnorm", [&] {
    rmsnorm_rows<scalar_t>(x, none, none, weight, out, eps);
  });
  return out;
}

// (rmsnorm(x + residual), x + residual), both [N, D]
std::vector<torch::Tensor> fused_add_rmsnorm(torch::Tensor x, torch::Tensor residual,
                                             torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must be x's shape and dtype");
  check_weight(x, weight);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  auto res_out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "fused_add_rmsnorm", [&] {
    rmsnorm_rows<scalar_t>(x, residual, res_out, weight, out, eps);
  });
  return {out, res_out};
}

// x [N, 2d] (gate | up) -> T(silu(gate)) * up [N, d]; silu(g) = g / (1 + exp(-g)) as torch's
template <typename T>
static void silu_and_mul_rows(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t N = x.size(0), d = x.size(1) / 2, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(d), up(d);
    for (int64_t r = begin; r < end; ++r) {
      to_float(xp + r * xs, gate.data(), d);
      to_float(xp + r * xs + d, up.data(), d);
      int64_t i = 0;
      for (; i + Vec::size() <= d; i += Vec::size()) {
        const Vec g = Vec::loadu(gate.data() + i);
        (g / (Vec(1.f) + g.neg().exp())).store(gate.data() + i);
      }
      for (; i < d; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i]));
      for (int64_t j = 0; j < d; ++j) op[r * d + j] = T(rounded<T>(gate[j]) * up[j]);
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [rows, 2 * d]: gate, then up");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x, out);
  });
  return out;
}

// Neox RoPE of one token's heads: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product
// and sum rounded to T as torch's `x * cos + rotate_half(x) * sin` rounds them.
template <typename T>
static inline void rotate_heads(const T* x, int64_t heads, int64_t head_stride, T* out,
                                const float* cos, const float* sin, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * head_stride;
    T* oh = out + h * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = float(xh[i]), x2 = float(xh[i + half]);
      oh[i] = T(rounded<T>(x1 * cos[i]) + rounded<T>(-x2 * sin[i]));
      oh[i + half] = T(rounded<T>(x2 * cos[i]) + rounded<T>(x1 * sin[i]));
    }
  }
}

template <typename T>
static void rope_tokens(const torch::Tensor& positions, const torch::Tensor& q,
                        const torch::Tensor& k, const torch::Tensor& inv_freq, torch::Tensor& q_out,
                        torch::Tensor& k_out) {
  const int64_t N = q.size(0), H = q.size(1), KVH = k.size(1), half = q.size(2) / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* inv = inv_freq.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> angle(half), cos(half), sin(half);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t i = 0; i < half; ++i) angle[i] = float(pos[n]) * inv[i];
      int64_t i = 0;
      for (; i + Vec::size() <= half; i += Vec::size()) {
        const Vec a = Vec::loadu(angle.data() + i);
        a.cos().store(cos.data() + i);
        a.sin().store(sin.data() + i);
      }
      for (; i < half; ++i) {
        cos[i] = std::cos(angle[i]);
        sin[i] = std::sin(angle[i]);
      }
      for (int64_t j = 0; j < half; ++j) {  // cos and sin in the model's dtype, as transformers
        cos[j] = rounded<T>(cos[j]);
        sin[j] = rounded<T>(sin[j]);
      }
      rotate_heads<T>(q.data_ptr<T>() + n * q.stride(0), H, q.stride(1),
                      q_out.data_ptr<T>() + n * H * 2 * half, cos.data(), sin.data(), half);
      rotate_heads<T>(k.data_ptr<T>() + n * k.stride(0), KVH, k.stride(1),
                      k_out.data_ptr<T>() + n * KVH * 2 * half, cos.data(), sin.data(), half);
    }
  });
}

// positions [N] int64, q [N, H, D], k [N, KVH, D] (any strides with D dense), inv_freq [D/2]
// float32 -> (q rotated, k rotated), contiguous.
std::vector<torch::Tensor> rotary_embedding(torch::Tensor positions, torch::Tensor q,
                                            torch::Tensor k, torch::Tensor inv_freq) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "q, k must be [N, heads, D] with D even and dense");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() &&
                  (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16),
              "q and k must share a dtype, float32 or bfloat16");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0), "positions must be int64 [N]");
  TORCH_CHECK(inv_freq.scalar_type() == torch::kFloat && inv_freq.is_contiguous() &&
                  inv_freq.numel() == q.size(2) / 2, "inv_freq must be float32 [D/2]");
  auto q_out = torch::empty(q.sizes(), q.options()), k_out = torch::empty(k.sizes(), k.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rotary_embedding", [&] {
    rope_tokens<scalar_t>(positions, q, k, inv_freq, q_out, k_out);
  });
  return {q_out, k_out};
}

// ---------------------------------------------------------------- few-row matmul (decode)
// y = x W^T (+ b) for x [M <= GEMV_MAX_ROWS, K] and W [N, K]. With a row or two of x, a matmul
// does 2 flops per weight it loads: the product is a read of W at memory speed, and a decode step
// at batch 1 is ~120 of them. oneDNN's kernels (stage 5's packed weights) are built for many rows.
// This one reads W in the layout block_for_gemv (kernels/cpu.py) gives it once, at load time:
//   [N / 8, K / V, 8, V]   V = 64 bytes of T (16 float32, 32 bfloat16), zero-padded to whole blocks
// each block's 8 rows interleaved one 64-byte piece at a time, so that a block is one run of
// memory read front to back (its 8 rows read side by side in the plain layout were 8 runs). Each
// thread takes a contiguous range of blocks and reads two of them at a time, one from each half
// of its range: two runs, and each run asks for the memory 1 KB ahead of where it reads (a
// software prefetch); on the 2-vCPU EPYC of stage 9's README each of the three read one step's
// matrices faster than without it. Its speed: `python -m common.bench gemv`. Every vector of W
// loaded is multiplied into all M rows of x; float32 accumulation whatever the dtype (as
// oneDNN's), the bias added before the one rounding.
constexpr int64_t GEMV_MAX_ROWS = 2;  // from 3 or 4 rows on oneDNN's kernels are as fast
constexpr int64_t BLOCK = 8;          // rows of W per block: their 8 sums fill one 256-bit vector
constexpr int64_t PREFETCH_BYTES = 1024;

// Ask for the piece 1 KB ahead of p (one 64-byte line of each of a block's 8 rows): past the end
// of W it is a harmless hint.
static inline void prefetch_ahead(const void* p) {
  for (int r = 0; r < BLOCK; ++r)
    __builtin_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES + r * 64, 0, 3);
}

template <typename T>
constexpr int64_t piece() { return 64 / sizeof(T); }  // V: elements of a 64-byte piece

#if defined(CPU_CAPABILITY_AVX512)
// The sums of 8 vectors' lanes, in one vector: half of a row's lanes added to the other half, then
// pairs of rows folded together (a fraction of the cost of 8 separate reductions, which, with rows
// of a few hundred weights, is noticeable).
static inline __m256 sum8(const __m512* a) {
  __m256 h[8];
  for (int r = 0; r < 8; ++r)
    h[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1));
  const __m256 s01 = _mm256_hadd_ps(h[0], h[1]), s23 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 s45 = _mm256_hadd_ps(h[4], h[5]), s67 = _mm256_hadd_ps(h[6], h[7]);
  // s0123: rows 0-3, each 128-bit half holding the sums of that half's lanes; s4567: rows 4-7
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

// The 8 sums of block rows n..n+7 (+ bias) into out[n..], the rows past N (padding) dropped.
template <typename T>
static void store_sums(const Vec* acc, const T* bias, T* out, int64_t n, int64_t N) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (n + BLOCK <= N) {
      const __m512 a[8] = {acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]};
      __m256 sums = sum8(a);
      if (bias) sums = _mm256_add_ps(sums, _mm256_loadu_ps(bias + n));
      _mm256_storeu_ps(out + n, sums);
      return;
    }
  }
#endif
  for (int64_t r = 0; r < BLOCK && n + r < N; ++r) {
    Vec a = acc[r];
    const float sum = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, a);
    out[n + r] = T(bias ? sum + float(bias[n + r]) : sum);
  }
}

// S blocks of W (numbers b[0..S)) against the M rows of x (float, [M, Kp]) -> out[m * N + ...].
template <typename T, int M, int S>
static void gemv_blocks(const T* w, int64_t Kp, const float* x, const T* bias, T* out, int64_t N,
                        const int64_t* b) {
  constexpr int64_t V = piece<T>();
  Vec acc[S][M][BLOCK];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < BLOCK; ++r) acc[s][m][r] = Vec(0.f);
  for (int64_t k = 0; k < Kp; k += V) {
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t j = 0; j < V; j += Vec::size()) {
        Vec xv[M];
        for (int m = 0; m < M; ++m) xv[m] = Vec::loadu(x + m * Kp + k + j);
        for (int s = 0; s < S; ++s) {
          const float* p = w + (b[s] * Kp + k) * BLOCK + j;  // piece k / V of block b[s]: [8, V]
          if (j == 0) prefetch_ahead(p);
          for (int r = 0; r < BLOCK; ++r) {
            const Vec wv = Vec::loadu(p + r * V);
            for (int m = 0; m < M; ++m) acc[s][m][r] = at::vec::fmadd(wv, xv[m], acc[s][m][r]);
          }
        }
      }
    } else {  // bfloat16 widened to two float vectors a load (CPUs without AVX512-BF16)
      using TVec = at::vec::Vectorized<T>;
      for (int64_t j = 0; j < V; j += TVec::size()) {
        for (int s = 0; s < S; ++s) {
          const T* p = w + (b[s] * Kp + k) * BLOCK + j;
          if (j == 0) prefetch_ahead(p);
          for (int r = 0; r < BLOCK; ++r) {
            auto [lo, hi] = at::vec::convert_to_float<T>(TVec::loadu(p + r * V));
            for (int m = 0; m < M; ++m) {
              const float* xk = x + m * Kp + k + j;
              acc[s][m][r] = at::vec::fmadd(lo, Vec::loadu(xk), acc[s][m][r]);
              acc[s][m][r] = at::vec::fmadd(hi, Vec::loadu(xk + Vec::size()), acc[s][m][r]);
            }
          }
        }
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m) store_sums<T>(acc[s][m], bias, out + m * N, b[s] * BLOCK, N);
}

#if defined(__AVX512BF16__)
// bfloat16 where the CPU has AVX512-BF16 (the instruction oneDNN's bfloat16 kernels use):
// vdpbf16ps multiplies 32 bfloat16 pairs of W and x and adds each pair's two products into a float
// lane, so x stays bfloat16 and nothing is widened. A piece (32 bfloat16) is one instruction.
template <int M, int S>
static void gemv_blocks_dpbf16(const at::BFloat16* w, int64_t Kp, const at::BFloat16* x,
                               const at::BFloat16* bias, at::BFloat16* out, int64_t N,
                               const int64_t* b) {
  __m512 acc[S][M][BLOCK];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < BLOCK; ++r) acc[s][m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 32) {
    for (int s = 0; s < S; ++s) {
      const at::BFloat16* p = w + (b[s] * Kp + k) * BLOCK;
      prefetch_ahead(p);
      __m512bh wv[BLOCK];
      for (int r = 0; r < BLOCK; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(p + r * 32);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * Kp + k);
        for (int r = 0; r < BLOCK; ++r) acc[s][m][r] = _mm512_dpbf16_ps(acc[s][m][r], wv[r], xv);
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n = b[s] * BLOCK;
    for (int m = 0; m < M; ++m) {
      at::BFloat16* o = out + m * N;
      if (n + BLOCK <= N) {  // 8 rows' sums in one vector, rounded to bfloat16 together
        __m256 sums = sum8(acc[s][m]);
        if (bias) {  // 8 bfloat16 widened: each one's bits in the top half of a float
          const __m128i b16 = _mm_loadu_si128((const __m128i*)(bias + n));
          sums = _mm256_add_ps(sums, _mm256_castsi256_ps(_mm256_slli_epi32(
                                         _mm256_cvtepu16_epi32(b16), 16)));
        }
        _mm_storeu_si128((__m128i*)(o + n), (__m128i)_mm256_cvtneps_pbh(sums));
      } else {
        for (int64_t r = 0; r < BLOCK && n + r < N; ++r) {
          const float sum = _mm512_reduce_add_ps(acc[s][m][r]);
          o[n + r] = at::BFloat16(bias ? sum + float(bias[n + r]) : sum);
        }
      }
    }
  }
}
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

template <typename T, int M, int S, typename X>
static inline void gemv_some(const T* w, int64_t Kp, const X* x, const T* bias, T* out, int64_t N,
                             const int64_t* b) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, at::BFloat16>) {
    gemv_blocks_dpbf16<M, S>(w, Kp, x, bias, out, N, b);
    return;
  }
#endif
  if constexpr (std::is_same_v<X, float>) gemv_blocks<T, M, S>(w, Kp, x, bias, out, N, b);
}

template <typename T, int M>
static void gemv_rows(const T* w, int64_t N, int64_t Kp, const torch::Tensor& x, const T* bias,
                      T* out) {
  // x as the blocks read it: bfloat16 for vdpbf16ps, float otherwise (gemv converts it)
  using X = std::conditional_t<kBf16Dot && std::is_same_v<T, at::BFloat16>, at::BFloat16, float>;
  const X* xp = x.data_ptr<X>();
  at::parallel_for(0, (N + BLOCK - 1) / BLOCK, 8, [&](int64_t b0, int64_t b1) {
    if constexpr (M == 1) {  // two blocks side by side, one from each half of the range
      const int64_t half = (b1 - b0) / 2;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t b[2] = {b0 + i, b0 + half + i};
        gemv_some<T, M, 2>(w, Kp, xp, bias, out, N, b);
      }
      const int64_t last = b1 - 1;  // an odd range's last block alone
      if ((b1 - b0) % 2) gemv_some<T, M, 1>(w, Kp, xp, bias, out, N, &last);
    } else {  // with two rows of x, two blocks' sums would not fit in the registers
      for (int64_t i = b0; i < b1; ++i) gemv_some<T, M, 1>(w, Kp, xp, bias, out, N, &i);
    }
  });
}

// x [M, K], weight: W [out_features, K] blocked by block_for_gemv, bias [out_features] or none ->
// [M, out_features], x's dtype
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias,
                   int64_t out_features) {
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(M >= 1 && M <= GEMV_MAX_ROWS, "gemv takes 1 to ", GEMV_MAX_ROWS, " rows, got ", M);
  const int64_t V = 64 / x.element_size(), Kp = (K + V - 1) / V * V;
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.size(0) == blocks &&
                  weight.size(1) == Kp / V && weight.size(2) == BLOCK && weight.size(3) == V,
              "weight must be a [", N, ", ", K, "] matrix of x's dtype blocked by block_for_gemv: ",
              "[", blocks, ", ", Kp / V, ", ", BLOCK, ", ", V, "], got ", weight.sizes());
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N &&
                        bias->scalar_type() == x.scalar_type()), "bias must be [N], x's dtype");
  // x as the blocks read it, [M, Kp]: zero-padded like W (a few KB, read again for every block)
  auto xk = x.scalar_type() == torch::kBFloat16 && !kBf16Dot ? x.to(torch::kFloat) : x.contiguous();
  if (Kp != K) xk = at::constant_pad_nd(xk, {0, Kp - K});
  auto out = torch::empty({M, N}, x.options());
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    const T *w = weight.data_ptr<T>(), *b = bias ? bias->data_ptr<T>() : nullptr;
    if (M == 1) gemv_rows<T, 1>(w, N, Kp, xk, b, out.data_ptr<T>());
    else gemv_rows<T, 2>(w, N, Kp, xk, b, out.data_ptr<T>());
  };
  if (x.scalar_type() == torch::kFloat) run(float());
  else run(at::BFloat16());
  return out;
}

// Registered as torch operators (stage9_moe_cpu::rmsnorm, ...): called through torch's dispatcher
// like its own operators, so torch.profiler names them and they cost no more to call.
TORCH_LIBRARY(stage9_moe_cpu, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor[]");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor inv_freq) -> Tensor[]");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(stage9_moe_cpu, CPU, m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("fused_add_rmsnorm", &fused_add_rmsnorm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("gemv", &gemv);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
