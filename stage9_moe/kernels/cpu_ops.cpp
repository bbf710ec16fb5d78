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
// y = x W^T (+ b) for x [M <= GEMV_MAX_ROWS, K] and W [N, K] in its plain row-major layout. With a
// row or two of x, a matmul does 2 flops per weight it loads: the product is a read of W at memory
// speed, and a decode step at batch 1 is ~120 of them. oneDNN's kernels (stage 5's packed weights)
// are built for many rows; this one reads W's rows front to back, once, each thread a contiguous
// run of them, R rows at a time, and multiplies every vector of W it loads into all M rows of x.
// float32 accumulation whatever the dtype (as oneDNN's), bias added before the one rounding.
constexpr int64_t GEMV_MAX_ROWS = 2;  // from 3 or 4 rows on oneDNN's kernels are as fast

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

// Rows [n, n + R) of W against the M rows of x (float, [M, K]) -> out[m * N + n + r].
template <typename T, int R, int M>
static void gemv_block(const T* w, int64_t K, const float* x, const T* bias, T* out, int64_t N,
                       int64_t n) {
  Vec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = Vec(0.f);
  auto step = [&](int64_t k, const Vec* wv) {
    for (int m = 0; m < M; ++m) {
      const Vec xv = Vec::loadu(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = at::vec::fmadd(wv[r], xv, acc[m][r]);
    }
  };
  int64_t k = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; k + Vec::size() <= K; k += Vec::size()) {
      Vec wv[R];
      for (int r = 0; r < R; ++r) wv[r] = Vec::loadu(w + (n + r) * K + k);
      step(k, wv);
    }
  } else {  // 2 * Vec::size() bfloat16 weights a load, widened to two float vectors
    for (; k + 2 * Vec::size() <= K; k += 2 * Vec::size()) {
      Vec lo[R], hi[R];
      for (int r = 0; r < R; ++r)
        std::tie(lo[r], hi[r]) = at::vec::convert_to_float<T>(
            at::vec::Vectorized<T>::loadu(w + (n + r) * K + k));
      step(k, lo);
      step(k + Vec::size(), hi);
    }
  }
  for (int m = 0; m < M; ++m) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (R == 8 && std::is_same_v<T, float>) {
      if (k == K) {
        const __m512 a[8] = {acc[m][0], acc[m][1], acc[m][2], acc[m][3],
                             acc[m][4], acc[m][5], acc[m][6], acc[m][7]};
        __m256 sums = sum8(a);
        if (bias) sums = _mm256_add_ps(sums, _mm256_loadu_ps(bias + n));
        _mm256_storeu_ps(out + m * N + n, sums);
        continue;
      }
    }
#endif
    for (int r = 0; r < R; ++r) {
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[m][r]);
      for (int64_t j = k; j < K; ++j) sum += float(w[(n + r) * K + j]) * x[m * K + j];
      out[m * N + n + r] = T(bias ? sum + float(bias[n + r]) : sum);
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16 where the CPU has AVX512-BF16 (the instruction oneDNN's bfloat16 kernels use):
// vdpbf16ps multiplies 32 bfloat16 pairs of W and x and adds each pair's two products into a float
// lane, so x stays bfloat16 and nothing is widened.
template <int R, int M>
static void gemv_block_dpbf16(const at::BFloat16* w, int64_t K, const at::BFloat16* x,
                              const at::BFloat16* bias, at::BFloat16* out, int64_t N, int64_t n) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  auto step = [&](int64_t k, auto load) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + (n + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, [](const at::BFloat16* p) {
    return (__m512bh)_mm512_loadu_si512(p); });
  const __mmask32 tail = __mmask32((1u << (K - k)) - 1);  // a masked load of the last K % 32
  if (k < K) step(k, [tail](const at::BFloat16* p) {
    return (__m512bh)_mm512_maskz_loadu_epi16(tail, p); });
  for (int m = 0; m < M; ++m) {
    if constexpr (R == 8) {  // 8 rows' sums in one vector, rounded to bfloat16 together
      __m256 sums = sum8(acc[m]);
      if (bias) {  // 8 bfloat16 widened: each one's bits in the top half of a float
        const __m128i b16 = _mm_loadu_si128((const __m128i*)(bias + n));
        sums = _mm256_add_ps(sums, _mm256_castsi256_ps(_mm256_slli_epi32(
                                       _mm256_cvtepu16_epi32(b16), 16)));
      }
      _mm_storeu_si128((__m128i*)(out + m * N + n), (__m128i)_mm256_cvtneps_pbh(sums));
    } else {
      for (int r = 0; r < R; ++r) {
        const float sum = _mm512_reduce_add_ps(acc[m][r]);
        out[m * N + n + r] = at::BFloat16(bias ? sum + float(bias[n + r]) : sum);
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

template <typename T, int M>
static void gemv_rows(const T* w, int64_t N, int64_t K, const torch::Tensor& x, const T* bias,
                      T* out) {
  constexpr int R = 8;  // M * R accumulators and R rows of W stay in registers
  // x as the blocks read it: bfloat16 for vdpbf16ps, float otherwise (gemv converts it)
  using X = std::conditional_t<kBf16Dot && std::is_same_v<T, at::BFloat16>, at::BFloat16, float>;
  const X* xp = x.data_ptr<X>();
  at::parallel_for(0, (N + R - 1) / R, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t n = b0 * R; n < std::min(b1 * R, N); n += R) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<X, at::BFloat16>) {
        if (n + R <= N) gemv_block_dpbf16<R, M>(w, K, xp, bias, out, N, n);
        else for (int64_t i = n; i < N; ++i) gemv_block_dpbf16<1, M>(w, K, xp, bias, out, N, i);
        continue;
      }
#endif
      if constexpr (std::is_same_v<X, float>) {
        if (n + R <= N) gemv_block<T, R, M>(w, K, xp, bias, out, N, n);
        else for (int64_t i = n; i < N; ++i) gemv_block<T, 1, M>(w, K, xp, bias, out, N, i);
      }
    }
  });
}

template <typename T>
static void gemv_typed(const torch::Tensor& x, const torch::Tensor& weight,
                       const std::optional<torch::Tensor>& bias, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const T* w = weight.data_ptr<T>();
  const T* b = bias ? bias->data_ptr<T>() : nullptr;
  T* o = out.data_ptr<T>();
  if (M == 1) gemv_rows<T, 1>(w, N, K, x, b, o);
  else gemv_rows<T, 2>(w, N, K, x, b, o);
}

// x [M, K], weight [N, K], bias [N] or none -> [M, N], x's dtype
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias) {
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= GEMV_MAX_ROWS, "gemv takes 1 to ", GEMV_MAX_ROWS, " rows, got ", M);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [N, ", K, "] tensor of x's dtype");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N &&
                        bias->scalar_type() == x.scalar_type()), "bias must be [N], x's dtype");
  auto out = torch::empty({M, N}, x.options());
  if (x.scalar_type() == torch::kFloat) {
    gemv_typed<float>(x.contiguous(), weight, bias, out);
  } else {  // [M, K] as the block reads it: a few KB, read again for every row of W
    gemv_typed<at::BFloat16>(kBf16Dot ? x.contiguous() : x.to(torch::kFloat), weight, bias, out);
  }
  return out;
}

// Registered as torch operators (stage9_moe_cpu::rmsnorm, ...): called through torch's dispatcher
// like its own operators, so torch.profiler names them and they cost no more to call.
TORCH_LIBRARY(stage9_moe_cpu, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor[]");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor inv_freq) -> Tensor[]");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(stage9_moe_cpu, CPU, m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("fused_add_rmsnorm", &fused_add_rmsnorm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("gemv", &gemv);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
