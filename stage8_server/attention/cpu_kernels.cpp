// Decode attention that reads the paged KV cache in place, on a CPU (cpu_backend.py builds this
// file once with torch's C++ extension loader and calls it). Two passes over a request's keys:
//
//   paged_qk: scores[b, h, p] = scale * q[b, h] . k[slot(b, p), h / G]   (-inf for p >= seq_len)
//   (softmax over p, in float32: torch's, between the two kernels)
//   paged_pv: out[b, h] = sum_p probs[b, h, p] * v[slot(b, p), h / G]
//
// slot(b, p) = page_table[req_rows[b], p / page_size] * page_size + p % page_size: the same lookup
// as the torch backend's kv_indices, done while reading instead of copying the keys out first.
// A thread takes one request at a time and walks its pages in order; each K/V head's row is read
// once for the G = H / KVH query heads that share it, so every key and value is read from memory
// once per step and layer, and a token's rows are read in the order they lie. Arithmetic is in
// float32 whatever the cache's dtype (bfloat16 rows are widened as they are read). A cache may be
// any strided view whose head_dim is dense (one layer of the pool is a view into all layers).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

constexpr int64_t MAX_HEADS = 64;  // query heads (of this rank)
constexpr int64_t MAX_HEAD_DIM = 256;

// A cache's strides (elements): a page, a token within its page, a K/V head; head_dim is dense.
struct CacheStrides {
  int64_t page, token, head;
};

// Rows of one token, widened to float32 once: a float32 cache is read where it lies.
template <typename T>
static inline const float* as_float(const T* row, int64_t n, float* buf) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = float(row[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* row, int64_t, float*) { return row; }

// Requests differ in length: threads take them one at a time (dynamic), not in equal halves.
template <typename F>
static void for_each_request(int64_t B, const F& f) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t b = 0; b < B; ++b) f(b);
}

template <typename T>
static void qk_kernel(const T* q, const T* k, CacheStrides ks, float* scores,
                      const int32_t* page_table, int64_t pt_stride, const int32_t* req_rows,
                      const int32_t* seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                      int64_t page_size, int64_t max_len, float scale) {
  const int64_t G = H / KVH;
  for_each_request(B, [&](int64_t b) {
    float qf[MAX_HEADS * MAX_HEAD_DIM], kf[MAX_HEAD_DIM];
    const int64_t len = seq_lens[b];
    const int32_t* pages = page_table + req_rows[b] * pt_stride;
    for (int64_t i = 0; i < H * D; ++i) qf[i] = float(q[b * H * D + i]) * scale;
    float* s = scores + b * H * max_len;  // [H, max_len]
    for (int64_t first = 0; first < len; first += page_size) {  // page by page
      const T* page = k + int64_t(pages[first / page_size]) * ks.page;
      const int64_t n = std::min(page_size, len - first);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t kvh = 0; kvh < KVH; ++kvh) {  // each key row read once, for its G heads
          const float* key = as_float(page + j * ks.token + kvh * ks.head, D, kf);
          for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
            const float* qh = qf + h * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * key[d];
            s[h * max_len + first + j] = dot;
          }
        }
      }
    }
    for (int64_t h = 0; h < H; ++h)  // padding up to max_len: no weight after the softmax
      std::fill(s + h * max_len + len, s + (h + 1) * max_len, -INFINITY);
  });
}

template <typename T>
static void pv_kernel(const float* probs, const T* v, CacheStrides vs, T* out,
                      const int32_t* page_table, int64_t pt_stride, const int32_t* req_rows,
                      const int32_t* seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                      int64_t page_size, int64_t max_len) {
  const int64_t G = H / KVH;
  for_each_request(B, [&](int64_t b) {
    float acc[MAX_HEADS * MAX_HEAD_DIM], vf[MAX_HEAD_DIM];
    const int64_t len = seq_lens[b];
    const int32_t* pages = page_table + req_rows[b] * pt_stride;
    const float* p = probs + b * H * max_len;  // [H, max_len]
    std::fill(acc, acc + H * D, 0.f);
    for (int64_t first = 0; first < len; first += page_size) {
      const T* page = v + int64_t(pages[first / page_size]) * vs.page;
      const int64_t n = std::min(page_size, len - first);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t kvh = 0; kvh < KVH; ++kvh) {
          const float* value = as_float(page + j * vs.token + kvh * vs.head, D, vf);
          for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
            const float w = p[h * max_len + first + j];
            float* a = acc + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * value[d];
          }
        }
      }
    }
    for (int64_t i = 0; i < H * D; ++i) out[b * H * D + i] = T(acc[i]);
  });
}

static CacheStrides strides_of(const torch::Tensor& cache) {
  return {cache.stride(0), cache.stride(1), cache.stride(2)};
}

static void check_inputs(const torch::Tensor& q, const torch::Tensor& cache,
                         const torch::Tensor& page_table, const torch::Tensor& req_rows,
                         const torch::Tensor& seq_lens) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D]");
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1,
              "a cache must be [num_pages, page_size, KVH, D] with head_dim dense");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "q and the cache must share a dtype");
  const int64_t H = q.size(1), KVH = cache.size(2);
  TORCH_CHECK(H % KVH == 0 && H <= MAX_HEADS && q.size(2) == cache.size(3) &&
                  q.size(2) <= MAX_HEAD_DIM,
              "unsupported heads / head_dim");
  TORCH_CHECK(page_table.scalar_type() == torch::kInt32 && page_table.stride(1) == 1 &&
                  req_rows.scalar_type() == torch::kInt32 && req_rows.is_contiguous() &&
                  seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "page_table, req_rows and seq_lens must be int32, rows contiguous");
}

// q: [B, H, D]; k_cache: [num_pages, page_size, KVH, D] -> scores [B, H, max_len] float32
torch::Tensor paged_qk(torch::Tensor q, torch::Tensor k_cache, torch::Tensor page_table,
                       torch::Tensor req_rows, torch::Tensor seq_lens, int64_t max_len,
                       double scale) {
  check_inputs(q, k_cache, page_table, req_rows, seq_lens);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  auto scores = torch::empty({B, H, max_len}, q.options().dtype(torch::kFloat32));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_qk", [&] {
    qk_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                        strides_of(k_cache), scores.data_ptr<float>(),
                        page_table.data_ptr<int32_t>(),
                        page_table.stride(0), req_rows.data_ptr<int32_t>(),
                        seq_lens.data_ptr<int32_t>(), B, H, k_cache.size(2), D, k_cache.size(1),
                        max_len, float(scale));
  });
  return scores;
}

// probs: [B, H, max_len] float32; v_cache like k_cache -> out [B, H, D] in the cache's dtype
torch::Tensor paged_pv(torch::Tensor probs, torch::Tensor v_cache, torch::Tensor page_table,
                       torch::Tensor req_rows, torch::Tensor seq_lens, torch::Tensor q) {
  check_inputs(q, v_cache, page_table, req_rows, seq_lens);
  TORCH_CHECK(probs.scalar_type() == torch::kFloat32 && probs.is_contiguous(), "float32 probs");
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_pv", [&] {
    pv_kernel<scalar_t>(probs.data_ptr<float>(), v_cache.data_ptr<scalar_t>(),
                        strides_of(v_cache), out.data_ptr<scalar_t>(),
                        page_table.data_ptr<int32_t>(),
                        page_table.stride(0), req_rows.data_ptr<int32_t>(),
                        seq_lens.data_ptr<int32_t>(), B, H, v_cache.size(2), D, v_cache.size(1),
                        probs.size(2));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_qk", &paged_qk, "q . k for every cached key, read through the page table");
  m.def("paged_pv", &paged_pv, "probs . v for every cached value, read through the page table");
}
