// Fused CPU kernels for the decode step: each replaces a chain of small PyTorch ops whose
// per-op dispatch cost, not arithmetic, dominated a SmolLM2 decode (see inferd/kernels/__init__.py).
// Arithmetic is float32 inside; inputs and outputs are float32 or bfloat16.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <limits>
#include <optional>
#include <vector>

namespace {

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// Loads that vectorize: a bfloat16 is the high half of a float32.
template <typename T>
inline float load_f(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}
inline float load_f(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i].x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rounding to the storage type, to nearest even; the bfloat16 one is bit arithmetic that
// vectorizes (finite inputs only, as everywhere under -ffast-math).
template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// int8 KV rows (inferd/kernels/kv_quant.py): `dim` codes, then the row's float16 scale, so a
// value is code * scale. A float cache's rows are the values themselves (scale 1, exact).
constexpr int64_t SCALE_BYTES = 2;
constexpr float INV_QMAX = 1.f / 127.f;

template <typename C>
inline int64_t row_width(int64_t dim) {
  return dim;
}
template <>
inline int64_t row_width<int8_t>(int64_t dim) {
  return dim + SCALE_BYTES;
}

template <typename C>
inline float row_scale(const C*, int64_t) {
  return 1.f;
}
template <>
inline float row_scale<int8_t>(const int8_t* row, int64_t dim) {
  c10::Half scale;
  std::memcpy(&scale.x, row + dim, SCALE_BYTES);
  return static_cast<float>(scale);
}

// One row of values (each already rounded to the activations' dtype) into an int8 cache row:
// kv_quant.quantize_rows's arithmetic step for step, so both write the same bytes:
// scale = float16(absmax / 127), code = round-half-even(x / scale), both divisions as
// multiplications by the float32 reciprocal.
inline void quantize_row(const float* x, int64_t dim, int8_t* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
  const c10::Half scale(amax * INV_QMAX);
  const float s = static_cast<float>(scale);
  const float inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t i = 0; i < dim; ++i) {
    const float code = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * inv)));
    dst[i] = static_cast<int8_t>(code);
  }
  std::memcpy(dst + dim, &scale.x, SCALE_BYTES);
}

// Rows per parallel task of the row-wise elementwise kernels (RMSNorm, RoPE + K/V write,
// SiLU * up): enough rows for ~32k values, never fewer than `least`. A batched decode's rows
// (16 x 576 values for SmolLM2's norm) are microseconds of work, less than waking and joining a
// second thread; on a loaded machine each fork/join waited for a descheduled thread and cost
// milliseconds (benchmarks/step_profile.md). Prompt chunks still split over the threads.
inline int64_t row_grain(int64_t row_values, int64_t least) {
  constexpr int64_t kTaskValues = 1 << 15;
  return std::max(least, kTaskValues / std::max<int64_t>(row_values, 1));
}

// Input checks: a kernel raises (a Python RuntimeError) on what it cannot take, and never reads
// or writes outside its tensors. Index tensors are checked element by element; that is a pass
// over a few hundred integers, next to kernels that read megabytes.
void check_tensor(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, not on ", t.device());
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions, not ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, not ", t.scalar_type());
}

void check_long(const torch::Tensor& t, const char* name, int64_t size) {
  check_tensor(t, name, 1);
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, not ", t.scalar_type());
  TORCH_CHECK(t.size(0) == size, name, " has ", t.size(0), " entries for ", size, " rows");
}

// Every entry of an int64 tensor in [lo, hi).
void check_range(const torch::Tensor& t, const char* name, int64_t lo, int64_t hi,
                 const char* what) {
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    TORCH_CHECK(p[i] >= lo && p[i] < hi, name, "[", i, "] = ", p[i], " is outside ", what, " [",
                lo, ", ", hi, ")");
  }
}

// The caches hold rows of the activations' dtype, or int8 rows: head_dim codes then the row's
// float16 scale (inferd/kernels/kv_quant.py). Returns the head size.
int64_t check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& x) {
  check_tensor(k_cache, "k_cache", 4);
  check_tensor(v_cache, "v_cache", 4);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache ", k_cache.sizes(), " and v_cache ",
              v_cache.sizes(), " differ in shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache is ",
              k_cache.scalar_type(), ", v_cache is ", v_cache.scalar_type());
  const bool quantized = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized || k_cache.scalar_type() == x.scalar_type(),
              "the caches must be int8 or have the dtype of the activations (", x.scalar_type(),
              "), not ", k_cache.scalar_type());
  const int64_t dim = k_cache.size(3) - (quantized ? SCALE_BYTES : 0);
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.size(2) > 0 && dim > 0, "empty cache shape ",
              k_cache.sizes());
  return dim;
}

void check_heads(int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(heads > 0 && heads % kv_heads == 0, heads,
              " query heads are not a multiple of ", kv_heads, " KV heads");
}

// Llama's RMSNorm: y = w * round(x * rsqrt(mean(x^2) + eps)), normalized in float32 and rounded
// to the input type before the weight, as the reference does. Gemma's (``unit_offset``): y =
// round((x * rsqrt(mean(x^2) + eps)) * (1 + w)), all in float32 and rounded once.
template <typename T>
void rms_norm_row(const T* xr, const T* w, T* yr, int64_t h, float eps, bool unit_offset) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) {
    float v = load_f(xr, i);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  if (unit_offset) {
    for (int64_t i = 0; i < h; ++i) yr[i] = from_f<T>(load_f(xr, i) * inv * (1.f + load_f(w, i)));
    return;
  }
  for (int64_t i = 0; i < h; ++i) {
    const T n = from_f<T>(load_f(xr, i) * inv);
    yr[i] = from_f<T>(load_f(w, i) * to_f(n));
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t h, float eps,
                   bool unit_offset) {
  at::parallel_for(0, rows, row_grain(h, 8), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(x + r * h, w, y + r * h, h, eps, unit_offset);
  });
}

void check_norm_weight(const torch::Tensor& x, const torch::Tensor& w, int64_t h) {
  check_tensor(w, "weight", 1);
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight is ", w.scalar_type(), ", x is ",
              x.scalar_type());
  TORCH_CHECK(h > 0 && w.size(0) == h, "weight has ", w.size(0), " entries for rows of ", h);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                       bool unit_offset) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension");
  check_tensor(x, "x", x.dim());
  check_float(x, "x");
  const int64_t h = x.size(-1);
  check_norm_weight(x, w, h);
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                            x.numel() / h, h, static_cast<float>(eps), unit_offset);
  });
  return y;
}

// Per-head RMSNorms of q and k inside fused QKV rows [n, (heads + 2 * kv_heads) * dim] (Qwen3's
// and Gemma 3's q/k norms), v copied: one call where the split, two norms and the concatenation
// took eight.
torch::Tensor qk_rms_norm(const torch::Tensor& qkv, const torch::Tensor& q_w,
                          const torch::Tensor& k_w, int64_t heads, int64_t kv_heads, double eps,
                          bool unit_offset) {
  check_tensor(qkv, "qkv", 2);
  check_float(qkv, "qkv");
  const int64_t dim = q_w.size(0);
  check_norm_weight(qkv, q_w, dim);
  check_norm_weight(qkv, k_w, dim);
  check_heads(heads, kv_heads);
  const int64_t width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(qkv.size(1) == width, "qkv rows have ", qkv.size(1), " values, not ", width);
  auto y = torch::empty_like(qkv);
  const int64_t n = qkv.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "qk_rms_norm", [&] {
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    scalar_t* out = y.data_ptr<scalar_t>();
    const scalar_t* qw = q_w.data_ptr<scalar_t>();
    const scalar_t* kw = k_w.data_ptr<scalar_t>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, n, row_grain(width, 8), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = x + r * width;
        scalar_t* yr = out + r * width;
        for (int64_t h = 0; h < heads + kv_heads; ++h)
          rms_norm_row(xr + h * dim, h < heads ? qw : kw, yr + h * dim, dim, e, unit_offset);
        std::copy(xr + (heads + kv_heads) * dim, xr + width, yr + (heads + kv_heads) * dim);
      }
    });
  });
  return y;
}

// The residual add and the RMSNorm after it, in one call (two per decoder layer): sum =
// round(x + delta) to the input type, as torch's add rounds it, then rms_norm_rows over that
// sum, the same code as rms_norm; returns (sum, normed sum), the bits of the two ops apart.
template <typename T>
void add_rows(const T* x, const T* delta, T* sum, int64_t rows, int64_t h) {
  at::parallel_for(0, rows, row_grain(h, 8), [&](int64_t begin, int64_t end) {
    const T* xr = x + begin * h;
    const T* dr = delta + begin * h;
    T* sr = sum + begin * h;
    const int64_t n = (end - begin) * h;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sr[i] = from_f<T>(load_f(xr, i) + load_f(dr, i));
  });
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& delta,
                                                      const torch::Tensor& w, double eps,
                                                      bool unit_offset) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension");
  check_tensor(x, "x", x.dim());
  check_tensor(delta, "delta", x.dim());
  check_float(x, "x");
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta ", delta.sizes(), " and x ", x.sizes(),
              " differ in shape");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type(), "delta is ", delta.scalar_type(),
              ", x is ", x.scalar_type());
  const int64_t h = x.size(-1);
  check_norm_weight(x, w, h);
  auto sum = torch::empty_like(x);
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const int64_t rows = x.numel() / h;
    add_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                       sum.data_ptr<scalar_t>(), rows, h);
    rms_norm_rows<scalar_t>(sum.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            y.data_ptr<scalar_t>(), rows, h, static_cast<float>(eps), unit_offset);
  });
  return {sum, y};
}

// Rotate-half RoPE of q and k straight out of the fused QKV rows, k and v written into the
// paged cache at their slots; returns the rotated queries [n, heads, dim].
// cos, signed_sin: float32 tables [max_pos, rot], signed_sin with its first half negated; the
// first rot channels of each head rotate, the rest pass through (partial rotary).
// C: the cache's element, T or int8 (then each k and v row is rounded to T as a float cache
// would hold it, then quantized with its own scale: quantize_row).
template <typename T, typename C>
void rope_rows(const T* qkv, const int64_t* pos, const int64_t* slots, const float* cos,
               const float* ssin, T* q, C* kc, C* vc, int64_t n, int64_t heads, int64_t kv_heads,
               int64_t dim, int64_t rot) {
  const int64_t half = rot / 2, width = (heads + 2 * kv_heads) * dim;
  const int64_t row = row_width<C>(dim);
  constexpr bool quantized = std::is_same_v<C, int8_t>;
  at::parallel_for(0, n, row_grain(width, 4), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(quantized ? dim : 0);
    for (int64_t r = begin; r < end; ++r) {
      const T* src_row = qkv + r * width;
      const float* c = cos + pos[r] * rot;
      const float* s = ssin + pos[r] * rot;
      // The first rot channels rotated and rounded to T, the rest as they are.
      const auto rotate = [&](const T* src, auto&& put) {
        for (int64_t i = 0; i < rot; ++i) {
          const int64_t j = i < half ? i + half : i - half;
          put(i, from_f<T>(load_f(src, i) * c[i] + load_f(src, j) * s[i]));
        }
        for (int64_t i = rot; i < dim; ++i) put(i, src[i]);
      };
      for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
        const T* src = src_row + hd * dim;
        const int64_t slot_row = slots[r] * kv_heads + (hd - heads);
        if (hd < heads) {
          T* dst = q + (r * heads + hd) * dim;
          rotate(src, [&](int64_t i, T x) { dst[i] = x; });
        } else if constexpr (quantized) {
          rotate(src, [&](int64_t i, T x) { tmp[i] = to_f(x); });
          quantize_row(tmp.data(), dim, kc + slot_row * row);
        } else {
          C* dst = kc + slot_row * row;
          rotate(src, [&](int64_t i, T x) { dst[i] = x; });
        }
      }
      const T* v = src_row + (heads + kv_heads) * dim;
      if constexpr (quantized) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          for (int64_t i = 0; i < dim; ++i) tmp[i] = load_f(v + h * dim, i);
          quantize_row(tmp.data(), dim, vc + (slots[r] * kv_heads + h) * row);
        }
      } else {
        std::copy(v, src_row + width, vc + slots[r] * kv_heads * dim);
      }
    }
  });
}

torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& positions,
                            const torch::Tensor& slots, const torch::Tensor& cos,
                            const torch::Tensor& signed_sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, int64_t heads) {
  check_tensor(qkv, "qkv", 2);
  check_float(qkv, "qkv");
  const int64_t dim = check_caches(k_cache, v_cache, qkv);
  const int64_t n = qkv.size(0), kv_heads = k_cache.size(2);
  check_heads(heads, kv_heads);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv rows have ", qkv.size(1),
              " values, not (", heads, " + 2 * ", kv_heads, ") heads of ", dim);
  check_tensor(cos, "cos", 2);
  check_tensor(signed_sin, "signed_sin", 2);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && signed_sin.scalar_type() == at::kFloat,
              "the rotary tables must be float32");
  TORCH_CHECK(cos.sizes() == signed_sin.sizes(), "cos ", cos.sizes(), " and signed_sin ",
              signed_sin.sizes(), " differ in shape");
  const int64_t rot = cos.size(1);
  TORCH_CHECK(rot > 0 && rot % 2 == 0 && rot <= dim, "a rotary table of width ", rot,
              " for heads of ", dim);
  check_long(positions, "positions", n);
  check_long(slots, "slots", n);
  check_range(positions, "positions", 0, cos.size(0), "the rotary table");
  check_range(slots, "slots", 0, k_cache.size(0) * k_cache.size(1), "the KV pool");
  auto q = torch::empty({n, heads, dim}, qkv.options());
  const bool quantized = k_cache.scalar_type() == at::kChar;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write_kv", [&] {
    const auto* x = qkv.data_ptr<scalar_t>();
    const auto* p = positions.data_ptr<int64_t>();
    const auto* sl = slots.data_ptr<int64_t>();
    const float* c = cos.data_ptr<float>();
    const float* s = signed_sin.data_ptr<float>();
    if (quantized) {
      rope_rows<scalar_t, int8_t>(x, p, sl, c, s, q.data_ptr<scalar_t>(),
                                  k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), n, heads,
                                  kv_heads, dim, rot);
    } else {
      rope_rows<scalar_t, scalar_t>(x, p, sl, c, s, q.data_ptr<scalar_t>(),
                                    k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), n,
                                    heads, kv_heads, dim, rot);
    }
  });
  return q;
}

// One query per sequence over its paged keys, one task per (sequence, query head) so that even
// a single sequence spreads over the threads. Kept as the baseline of
// benchmarks/kernels_attention.py (decode_attention's `grouped` = false); the grouped kernel below
// runs the model. softcap > 0: scores become softcap *
// tanh(s / softcap); window > 0: only the last `window` keys are visible.
template <typename T, typename C>
void decode_rows(const T* q, const C* kc, const C* vc, const int64_t* tables, const int64_t* lens,
                 T* out, int64_t batch, int64_t max_blocks, int64_t block_size, int64_t heads,
                 int64_t kv_heads, int64_t dim, float scale, float softcap, int64_t window) {
  const int64_t group = heads / kv_heads, row = row_width<C>(dim);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(dim), acc(dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads, kh = h / group, len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t* table = tables + b * max_blocks;
      const T* qh = q + (b * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) qf[i] = load_f(qh, i) * scale;
      scores.resize(len - first);
      float peak = -std::numeric_limits<float>::max();
      for (int64_t t = first; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const C* k = kc + (slot * kv_heads + kh) * row;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < dim; ++i) s += qf[i] * load_f(k, i);
        s *= row_scale(k, dim);
        if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
        scores[t - first] = s;
        peak = std::max(peak, s);
      }
      float total = 0.f;
      for (float& s : scores) {
        s = std::exp(s - peak);
        total += s;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const C* v = vc + (slot * kv_heads + kh) * row;
        const float p = scores[t - first] / total * row_scale(v, dim);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) acc[i] += p * load_f(v, i);
      }
      T* o = out + (b * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = from_f<T>(acc[i]);
    }
  });
}

// The same attention, each KV head's rows read once for all the query heads of its group (a
// per-query-head task reads them `group` times: 4x the traffic at 32/8 heads). One task per
// (sequence, KV head, chunk of keys): a long context is split into chunks so that a single
// sequence still spreads over the threads, each chunk keeping its own softmax max, sum and
// weighted values, merged per query head afterwards. A row's chunks depend on its own length
// only (CHUNK_KEYS keys from its first visible one), never on the other rows of the batch, so a
// row's result has the same bits whatever runs beside it (--deterministic relies on that).
constexpr int64_t CHUNK_KEYS = 128;

// Calls f(t, slot) for the keys lo..hi-1 of one sequence, block by block (no division per key).
template <typename F>
inline void for_each_slot(const int64_t* table, int64_t block_size, int64_t lo, int64_t hi,
                          F&& f) {
  int64_t t = lo, block = lo / block_size, offset = lo % block_size;
  while (t < hi) {
    const int64_t base = table[block] * block_size;
    const int64_t stop = std::min(hi, t + block_size - offset);
    for (; t < stop; ++t) f(t, base + offset++);
    ++block;
    offset = 0;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// The AVX-512 path of the grouped kernel for bfloat16 activations over bfloat16 or int8 caches
// with heads of 64, 128 or 256 values. Where the time went before (one horizontal sum per key and
// query head, a scalar exp per score, each V row widened once per query head), and what replaces it:
// - scores 16 keys at a time: per key a 16-lane vector of pairwise products from
//   _mm512_dpbf16_ps on the raw bf16 q and K rows (q is bf16 already, so the softmax scale is
//   applied after the dot product: no rounding of q * scale), then one transpose-reduce of the
//   16 vectors into the 16 scores; an int8 tile is widened to bf16 once for the group (exact:
//   codes are integers of 8 bits) and its row scales applied to the 16 scores;
// - the exponentials 16 at a time (exp_ps);
// - values for up to values_heads<D>() query heads per pass over the V rows, each row widened
//   once per pass, accumulators in registers;
// - software prefetch of the rows ahead: a sequence's blocks are scattered over the pool, where
//   the hardware prefetcher loses the stream at each block edge.
// 16 rows x 256 keys of SmolLM2 (9/3 heads of 64), before -> after, one thread: 230 -> 135 us
// with a bf16 cache and 520 -> 180 us with an int8 one in cache, 690 -> 390 and 1050 -> 300 us
// with the rows in DRAM (benchmarks/kernels_attention.py --old-kernels, --layers 30). Scores
// and weights differ from the generic loop's by float32 rounding only (other summation order).
inline __m512 bf16_even_ps(const void* p) {  // elements 0, 2, .. 30 of 32 bfloat16 as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
inline __m512 bf16_odd_ps(const void* p) {  // elements 1, 3, .. 31
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 int8x16_to_ps(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Lane i of the result: the sum of v[i]'s 16 lanes (four rounds of shuffles and adds for all 16).
inline __m512 transpose_sum(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                  _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                  _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// e^x for x <= 0 (scores less their maximum), 16 at a time: x = n ln2 + r with |r| <= ln2 / 2,
// e^r by a polynomial of degree 7 (relative error ~2e-7, as std::exp's float to a unit or two),
// times 2^n by scalef. Below -87 the result is ~0 and flushed: such a weight changes no sum.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2, two parts (exact n*hi)
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

template <int64_t D, typename C>
inline void prefetch_row(const C* row) {
  constexpr int64_t bytes = D * static_cast<int64_t>(sizeof(C));
  for (int64_t at = 0; at < bytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + at, _MM_HINT_T0);
}

// Query heads whose value accumulators (D / 16 registers each) one pass over the V rows keeps.
template <int64_t D>
constexpr int values_heads() {
  return D == 64 ? 4 : D == 128 ? 3 : 1;
}
constexpr int kTile = 16;  // keys whose scores one transpose-reduce yields

// Heads g0 .. g0 + G - 1 of the group: weights `w` (scores after the exp, CHUNK_KEYS apart per
// head, times the V row's scale for int8) against the chunk's n V rows, unnormalized.
template <int64_t D, int G, typename C>
void values_pass(const C* const* vrows, const float* vscale, const float* w, int64_t n,
                 float* part, int64_t stride) {
  constexpr int64_t V = D / 16;
  constexpr int64_t ahead = 8;  // rows prefetched ahead of the one read
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int64_t j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    if (t + ahead < n) prefetch_row<D>(vrows[t + ahead]);
    const C* v = vrows[t];
    const float s = std::is_same_v<C, int8_t> ? vscale[t] : 1.f;
    __m512 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(w[g * CHUNK_KEYS + t] * s);
    for (int64_t j = 0; j < V; ++j) {
      __m512 x;
      if constexpr (std::is_same_v<C, int8_t>) {
        x = int8x16_to_ps(v + 16 * j);
      } else {  // bf16: even elements of 32 in accumulator j, odd ones in j + 1
        x = j % 2 == 0 ? bf16_even_ps(v + 16 * j) : bf16_odd_ps(v + 16 * (j - 1));
      }
      for (int g = 0; g < G; ++g) acc[g][j] = _mm512_fmadd_ps(p[g], x, acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* out = part + g * stride + 2;
    if constexpr (std::is_same_v<C, int8_t>) {
      for (int64_t j = 0; j < V; ++j) _mm512_storeu_ps(out + 16 * j, acc[g][j]);
    } else {  // interleave the even and odd elements back
      const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512i hi =
          _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
      for (int64_t j = 0; j < V; j += 2) {
        _mm512_storeu_ps(out + 16 * j, _mm512_permutex2var_ps(acc[g][j], lo, acc[g][j + 1]));
        _mm512_storeu_ps(out + 16 * j + 16,
                         _mm512_permutex2var_ps(acc[g][j], hi, acc[g][j + 1]));
      }
    }
  }
}

template <int64_t D, typename C>
using ValuesPass = void (*)(const C* const*, const float*, const float*, int64_t, float*, int64_t);

template <int64_t D, typename C>
void values(const C* const* vrows, const float* vscale, const float* w, int64_t n, int64_t group,
            float* part, int64_t stride) {
  static constexpr ValuesPass<D, C> passes[] = {values_pass<D, 1, C>, values_pass<D, 2, C>,
                                                values_pass<D, 3, C>, values_pass<D, 4, C>};
  for (int64_t g0 = 0; g0 < group; g0 += values_heads<D>()) {
    const int64_t g = std::min<int64_t>(values_heads<D>(), group - g0);
    passes[g - 1](vrows, vscale, w + g0 * CHUNK_KEYS, n, part + g0 * stride, stride);
  }
}

// The cache lines of the slots of keys lo..hi-1 of one sequence (every KV head's K and V rows,
// side by side in a slot), appended to `lines`.
template <typename C>
inline void slot_lines(const C* kc, const C* vc, const int64_t* table, int64_t block_size,
                       int64_t kv_heads, int64_t row, int64_t lo, int64_t hi,
                       std::vector<const char*>& lines) {
  const int64_t span = kv_heads * row * static_cast<int64_t>(sizeof(C));
  for_each_slot(table, block_size, lo, hi, [&](int64_t, int64_t slot) {
    const char* k = reinterpret_cast<const char*>(kc + slot * kv_heads * row);
    const char* v = reinterpret_cast<const char*>(vc + slot * kv_heads * row);
    for (int64_t at = 0; at < span; at += 64) {
      lines.push_back(k + at);
      lines.push_back(v + at);
    }
  });
}

// Into L1 (T0): the lines are read within a task or two, and T1 (L2 only) ran the attention of
// 16 rows x 256-1024 keys over scattered blocks 1.05-1.08x slower on this machine's Zen 5
// (SmolLM2's shapes, 30 layers cold; the kernels of two builds alternating).
inline void prefetch_lines(const char* const* lines, int64_t n) {
  for (int64_t i = 0; i < n; ++i) _mm_prefetch(lines[i], _MM_HINT_T0);
}

// One chunk (keys lo..hi-1, at most CHUNK_KEYS) of one (sequence, KV head): for each of the
// group's query heads (q: their bf16 rows, side by side) the chunk's maximum score, sum of
// exponentials and weighted values into `part` (stride apart), as the generic loop writes them.
// `scores`: group * CHUNK_KEYS floats; `kb`: kTile * D bf16 (an int8 tile widened).
template <int64_t D, typename C>
void grouped_chunk_avx512(const c10::BFloat16* q, int64_t group, float scale, const C* kc,
                          const C* vc, const int64_t* table, int64_t block_size,
                          int64_t kv_heads, int64_t kh, int64_t lo, int64_t hi, float softcap,
                          float* scores, c10::BFloat16* kb, float* part, int64_t stride,
                          const char* const* ahead, int64_t ahead_n) {
  constexpr bool quantized = std::is_same_v<C, int8_t>;
  constexpr int64_t row = quantized ? D + SCALE_BYTES : D;
  const int64_t n = hi - lo, tiles = (n + kTile - 1) / kTile;
  const C* krows[CHUNK_KEYS];
  const C* vrows[CHUNK_KEYS];
  alignas(64) float kscale[CHUNK_KEYS], vscale[CHUNK_KEYS];
  for_each_slot(table, block_size, lo, hi, [&](int64_t t, int64_t slot) {
    const int64_t at = (slot * kv_heads + kh) * row;
    krows[t - lo] = kc + at;
    vrows[t - lo] = vc + at;
  });
  for (int64_t t = n; t < tiles * kTile; ++t) krows[t] = krows[0];  // read, never kept
  if constexpr (quantized) {
    for (int64_t t = 0; t < n; ++t) {
      kscale[t] = row_scale(krows[t], D) * scale;
      vscale[t] = row_scale(vrows[t], D);
    }
  }
  float* peak = part;  // part[g * stride]: the running maximum of head g
  for (int64_t g = 0; g < group; ++g) peak[g * stride] = -std::numeric_limits<float>::max();
  // Lines of the chunk the thread takes next, spread over the tiles (issued at once they
  // would hold up this chunk's own loads).
  const int64_t per_tile = (ahead_n + tiles - 1) / tiles;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t from = std::min(ahead_n, tile * per_tile);
    prefetch_lines(ahead + from, std::min(ahead_n, from + per_tile) - from);
    const C* const* rows = krows + tile * kTile;
    if (tile + 1 < tiles)
      for (int k = 0; k < kTile; ++k) prefetch_row<D>(rows[kTile + k]);
    else  // the chunk's first V rows, for the values pass
      for (int64_t t = 0; t < std::min<int64_t>(n, kTile); ++t) prefetch_row<D>(vrows[t]);
    const c10::BFloat16* k16[kTile];
    if constexpr (quantized) {  // widen the tile to bf16 once for the group (exactly)
      for (int k = 0; k < kTile; ++k) {
        c10::BFloat16* dst = kb + k * D;
        k16[k] = dst;
        for (int64_t i = 0; i < D; i += 32) {
          const __m512 a = int8x16_to_ps(rows[k] + i), b = int8x16_to_ps(rows[k] + i + 16);
          _mm512_storeu_si512(dst + i, (__m512i)(_mm512_cvtne2ps_pbh(b, a)));
        }
      }
    } else {
      for (int k = 0; k < kTile; ++k) k16[k] = rows[k];
    }
    const int64_t valid = std::min<int64_t>(kTile, n - tile * kTile);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 factor =
        quantized ? _mm512_loadu_ps(kscale + tile * kTile) : _mm512_set1_ps(scale);
    for (int64_t g = 0; g < group; ++g) {
      __m512bh qg[D / 32];
      for (int64_t i = 0; i < D / 32; ++i)
        qg[i] = (__m512bh)(_mm512_loadu_si512(q + g * D + 32 * i));
      __m512 dots[kTile];
      for (int k = 0; k < kTile; ++k) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < D / 32; ++i)
          a = _mm512_dpbf16_ps(a, qg[i], (__m512bh)(_mm512_loadu_si512(k16[k] + 32 * i)));
        dots[k] = a;
      }
      __m512 s = _mm512_mul_ps(transpose_sum(dots), factor);
      if (softcap > 0.f) {
        alignas(64) float e[kTile];
        _mm512_store_ps(e, s);
        for (float& x : e) x = softcap * std::tanh(x / softcap);
        s = _mm512_load_ps(e);
      }
      _mm512_mask_storeu_ps(scores + g * CHUNK_KEYS + tile * kTile, mask, s);
      peak[g * stride] = std::max(peak[g * stride], _mm512_mask_reduce_max_ps(mask, s));
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * CHUNK_KEYS;
    const __m512 top = _mm512_set1_ps(peak[g * stride]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 m = static_cast<__mmask16>(n - t >= 16 ? 0xFFFFu : (1u << (n - t)) - 1u);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + t), top));
      _mm512_mask_storeu_ps(sg + t, m, e);
      total = _mm512_mask_add_ps(total, m, total, e);
    }
    part[g * stride + 1] = _mm512_reduce_add_ps(total);
  }
  values<D, C>(vrows, vscale, scores, n, group, part, stride);
}
#endif

// Whether grouped_chunk_avx512 serves these types on this build (heads of 64, 128 or 256).
template <typename T, typename C>
constexpr bool fast_heads() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16> &&
         (std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, int8_t>);
#else
  return false;
#endif
}

template <typename T, typename C>
void decode_rows_grouped(const T* q, const C* kc, const C* vc, const int64_t* tables,
                         const int64_t* lens, T* out, int64_t batch, int64_t max_blocks,
                         int64_t block_size, int64_t heads, int64_t kv_heads, int64_t dim,
                         float scale, float softcap, int64_t window) {
  const int64_t group = heads / kv_heads, row = row_width<C>(dim);
  // Chunk slots per (sequence, KV head): the longest row's; shorter rows leave theirs empty.
  int64_t longest = 1;
  for (int64_t b = 0; b < batch; ++b)
    longest = std::max(longest, window > 0 ? std::min(lens[b], window) : lens[b]);
  const int64_t chunks = (longest + CHUNK_KEYS - 1) / CHUNK_KEYS;
  // Per (sequence, KV head, chunk, query head of the group): max, sum, then dim weighted values.
  const int64_t stride = dim + 2;
  std::vector<float> partial(batch * kv_heads * chunks * group * stride);
  // The keys [lo, hi) of a task's chunk.
  const auto keys_of = [&](int64_t task) {
    const int64_t c = (task / kv_heads) % chunks, len = lens[task / (chunks * kv_heads)];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t lo = first + c * CHUNK_KEYS;
    return std::pair<int64_t, int64_t>(lo, std::min(len, lo + CHUNK_KEYS));
  };
  at::parallel_for(0, batch * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), scores, acc(dim);
    std::vector<c10::BFloat16> kb;  // the fast path's int8 tile, widened
    std::vector<const char*> ahead;  // the fast path's lines to prefetch
    for (int64_t task = begin; task < end; ++task) {
      // KV heads innermost: a thread's consecutive tasks read the K/V heads of the same slots,
      // which lie side by side in the cache (the hardware prefetcher sees one stream).
      const int64_t kh = task % kv_heads, c = (task / kv_heads) % chunks;
      const int64_t b = task / (chunks * kv_heads);
      const auto [lo, hi] = keys_of(task);
      float* part = partial.data() + ((b * kv_heads + kh) * chunks + c) * group * stride;
      const int64_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = q + (b * heads + kh * group + g) * dim;
        for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] = load_f(qh, i) * scale;
        part[g * stride] = -std::numeric_limits<float>::max();
        part[g * stride + 1] = 0.f;
        std::fill(part + g * stride + 2, part + (g + 1) * stride, 0.f);
      }
      if (hi <= lo) continue;  // an empty chunk: weight 0 in the merge
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
      if constexpr (fast_heads<T, C>()) {
        const auto fast = dim == 64    ? grouped_chunk_avx512<64, C>
                          : dim == 128 ? grouped_chunk_avx512<128, C>
                          : dim == 256 ? grouped_chunk_avx512<256, C>
                                       : nullptr;
        if (fast != nullptr) {
          if (scores.size() < static_cast<size_t>(group * CHUNK_KEYS))
            scores.resize(group * CHUNK_KEYS);
          if (kb.size() < static_cast<size_t>(kTile * dim)) kb.resize(kTile * dim);
          // The rows come from DRAM in the model (the weight matmuls between two layers'
          // attention evict them). The thread's first chunk is fetched into cache whole by its
          // first KV head's task (the next heads' tasks read the rest: ~1.3-1.7x over this
          // head's rows only, in a 30-layer rotation); from then on each task fetches its
          // share of the chunk the thread takes next, a few lines a tile, so that it arrives
          // while this one computes.
          if (kh == 0 && kv_heads > 1 && task - begin < kv_heads) {
            ahead.clear();
            slot_lines(kc, vc, table, block_size, kv_heads, row, lo, hi, ahead);
            prefetch_lines(ahead.data(), static_cast<int64_t>(ahead.size()));
          }
          ahead.clear();
          const int64_t next = task - kh + kv_heads;  // the next chunk's first task
          if (next < end) {
            const auto [nlo, nhi] = keys_of(next);
            const int64_t* ntable = tables + (next / (chunks * kv_heads)) * max_blocks;
            const int64_t share = std::max<int64_t>(nhi - nlo, 0);
            slot_lines(kc, vc, ntable, block_size, kv_heads, row, nlo + share * kh / kv_heads,
                       nlo + share * (kh + 1) / kv_heads, ahead);
          }
          fast(q + (b * heads + kh * group) * dim, group, scale, kc, vc, table, block_size,
               kv_heads, kh, lo, hi, softcap, scores.data(), kb.data(), part, stride,
               ahead.data(), static_cast<int64_t>(ahead.size()));
          continue;
        }
      }
#endif
      const int64_t n = hi - lo;
      scores.resize(n);
      // Query head by query head over the chunk: the first reads its K and V rows from memory,
      // the rest of the group from cache (a chunk is at most CHUNK_KEYS rows).
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf.data() + g * dim;
        float peak = -std::numeric_limits<float>::max();
        for (int64_t t = lo; t < hi; ++t) {
          const int64_t slot = table[t / block_size] * block_size + t % block_size;
          const C* k = kc + (slot * kv_heads + kh) * row;
          float sc = 0.f;
#pragma omp simd reduction(+ : sc)
          for (int64_t i = 0; i < dim; ++i) sc += qg[i] * load_f(k, i);
          sc *= row_scale(k, dim);  // an int8 row's scale, once per key rather than per value
          if (softcap > 0.f) sc = softcap * std::tanh(sc / softcap);
          scores[t - lo] = sc;
          peak = std::max(peak, sc);
        }
        float total = 0.f;
        for (float& e : scores) {
          e = std::exp(e - peak);
          total += e;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = lo; t < hi; ++t) {
          const int64_t slot = table[t / block_size] * block_size + t % block_size;
          const C* v = vc + (slot * kv_heads + kh) * row;
          const float p = scores[t - lo] * row_scale(v, dim);
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) acc[i] += p * load_f(v, i);
        }
        part[g * stride] = peak;
        part[g * stride + 1] = total;
        std::copy(acc.begin(), acc.end(), part + g * stride + 2);
      }
    }
  });
  // Merge each query head's chunks: weights exp(max_c - max) rescale sums and values alike.
  at::parallel_for(0, batch * heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(dim);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads, kh = h / group, g = h % group;
      const float* base = partial.data() + ((b * kv_heads + kh) * chunks) * group * stride;
      float peak = -std::numeric_limits<float>::max();
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = base + (c * group + g) * stride;
        if (part[1] > 0.f) peak = std::max(peak, part[0]);
      }
      float total = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = base + (c * group + g) * stride;
        if (part[1] <= 0.f) continue;
        const float w = std::exp(part[0] - peak);
        total += w * part[1];
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) acc[i] += w * part[2 + i];
      }
      T* o = out + bh * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = from_f<T>(acc[i] / total);
    }
  });
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                               const torch::Tensor& lens, double scale, double softcap,
                               int64_t window, bool grouped = true) {
  check_tensor(q, "q", 3);
  check_float(q, "q");
  const int64_t cache_dim = check_caches(k_cache, v_cache, q);
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  check_heads(heads, k_cache.size(2));
  TORCH_CHECK(cache_dim == dim, "heads of ", dim, " over a cache of heads of ", cache_dim);
  check_tensor(block_tables, "block_tables", 2);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.size(0) == batch,
              "block_tables must be int64 [", batch, ", max_blocks]");
  check_long(lens, "lens", batch);
  check_range(lens, "lens", 1, block_tables.size(1) * block_size + 1, "the block tables' keys");
  TORCH_CHECK(window >= 0, "window ", window, " is negative");
  // Only the blocks a sequence reaches are read; padding past them may hold anything.
  const int64_t* tbl = block_tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < (len[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tbl[b * block_tables.size(1) + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", b, ", ", i, "] = ", block,
                  " is outside the KV pool [0, ", num_blocks, ")");
    }
  }
  auto out = torch::empty_like(q);
  const bool quantized = k_cache.scalar_type() == at::kChar;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    const auto run = [&](auto rows, const auto* kc, const auto* vc) {
      rows(q.data_ptr<scalar_t>(), kc, vc, block_tables.data_ptr<int64_t>(),
           lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch, block_tables.size(1),
           block_size, heads, k_cache.size(2), dim, static_cast<float>(scale),
           static_cast<float>(softcap), window);
    };
    if (quantized) {
      run(grouped ? decode_rows_grouped<scalar_t, int8_t> : decode_rows<scalar_t, int8_t>,
          k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    } else {
      run(grouped ? decode_rows_grouped<scalar_t, scalar_t> : decode_rows<scalar_t, scalar_t>,
          k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
    }
  });
  return out;
}

// act(gate) * up over rows laid out [gate | up], as the fused gate/up projection writes them;
// the activation rounded to T before the product, as the reference's two ops do.
template <typename T, typename Act>
void gated_rows(const T* x, T* y, int64_t rows, int64_t inter, Act act) {
  at::parallel_for(0, rows, row_grain(3 * inter, 4), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * inter;
      const T* up = gate + inter;
      T* yr = y + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i)
        yr[i] = from_f<T>(to_f(from_f<T>(act(load_f(gate, i)))) * load_f(up, i));
    }
  });
}

// The activations as types, so each instantiation inlines its own.
struct Silu {
  float operator()(float g) const { return g / (1.f + std::exp(-g)); }
};

struct GeluTanh {  // GELU, tanh approximation (Gemma's GeGLU)
  float operator()(float g) const {
    constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
    constexpr float kKappa = 0.044715f;
    return 0.5f * g * (1.f + std::tanh(kBeta * (g + kKappa * g * g * g)));
  }
};

template <typename Act>
torch::Tensor gated_mul(const torch::Tensor& x, Act act) {
  check_tensor(x, "x", 2);
  check_float(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "rows of ", x.size(1), " values do not split into gate | up");
  const int64_t inter = x.size(1) / 2;
  auto y = torch::empty({x.size(0), inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gated_mul", [&] {
    gated_rows<scalar_t>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0), inter, act);
  });
  return y;
}

torch::Tensor silu_mul(const torch::Tensor& x) { return gated_mul(x, Silu{}); }

torch::Tensor gelu_tanh_mul(const torch::Tensor& x) { return gated_mul(x, GeluTanh{}); }

// Weight-only GEMV / small GEMM: bound by streaming the weights, so each weight row is read once
// for all input rows (up to 4 at a time, from L1 after the first) and dequantized in registers.
// Activations are float32 inside (bf16 ones are widened first: a few KB); one task per block of
// output rows.
constexpr int64_t ROW_TILE = 4;
constexpr int64_t INT4_GROUP = 32;

std::vector<float> widen(const torch::Tensor& x) {
  std::vector<float> xf(x.numel());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "widen", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    for (int64_t i = 0; i < x.numel(); ++i) xf[i] = load_f(p, i);
  });
  return xf;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 bytes_to_ps(__m128i b) {  // the low 8 unsigned bytes as floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}
#endif

// One output row o of the int4 kernel for `rows` (<= ROW_TILE) input rows: codes as packed by
// inferd.layers.linear.pack_int4_rows (byte j of a group: column j low nibble, j + 16 high),
// w = code * scale + min per group, so x . w = sum_g scale_g * (x_g . codes_g) + min_g * sum(x_g).
inline void int4_row(const float* x, const float* xsum, const uint8_t* w, const float* sm,
                     float* out, int64_t rows, int64_t k) {
  const int64_t groups = k / INT4_GROUP;
  float bias[ROW_TILE] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < rows; ++r) bias[r] += sm[2 * g + 1] * xsum[r * groups + g];
#if defined(__AVX2__) && defined(__FMA__)
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[ROW_TILE] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                          _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m256 w0 = bytes_to_ps(lo), w1 = bytes_to_ps(_mm_srli_si128(lo, 8));
    const __m256 w2 = bytes_to_ps(hi), w3 = bytes_to_ps(_mm_srli_si128(hi, 8));
    const __m256 scale = _mm256_set1_ps(sm[2 * g]);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xg = x + r * k + g * INT4_GROUP;
      const __m256 d0 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), w1,
                                        _mm256_mul_ps(_mm256_loadu_ps(xg), w0));
      const __m256 d1 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w3,
                                        _mm256_mul_ps(_mm256_loadu_ps(xg + 16), w2));
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(d0, d1), scale, acc[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) out[r] = hsum(acc[r]) + bias[r];
#else
  for (int64_t r = 0; r < rows; ++r) {
    float total = bias[r];
    for (int64_t g = 0; g < groups; ++g) {
      float d = 0.f;
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t b = w[g * 16 + j];
        d += x[r * k + g * INT4_GROUP + j] * static_cast<float>(b & 0x0F) +
             x[r * k + g * INT4_GROUP + 16 + j] * static_cast<float>(b >> 4);
      }
      total += sm[2 * g] * d;
    }
    out[r] = total;
  }
#endif
}

// One output row of the int8 kernel (one scale per row) for `rows` (<= ROW_TILE) input rows.
inline void int8_row(const float* x, const int8_t* w, float scale, float* out, int64_t rows,
                     int64_t k) {
  int64_t i = 0;
  float tail[ROW_TILE] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__) && defined(__FMA__)
  // Two accumulators per row: the loop-carried FMA latency, not the loads, would bound one.
  __m256 a0[ROW_TILE], a1[ROW_TILE];
  for (int64_t r = 0; r < ROW_TILE; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    for (int64_t r = 0; r < rows; ++r) {
      a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i + 8), w1, a1[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) tail[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
#endif
  for (; i < k; ++i)
    for (int64_t r = 0; r < rows; ++r) tail[r] += x[r * k + i] * static_cast<float>(w[i]);
  for (int64_t r = 0; r < rows; ++r) out[r] = tail[r] * scale;
}

// y[r, o] for all rows in tiles of `Tile`, parallel over blocks of output rows; `row_fn`
// computes one output row for one tile into out[0..rows).
template <typename T, int64_t Tile = ROW_TILE, typename RowFn>
void weight_only_rows(int64_t rows, int64_t n, T* y, RowFn row_fn) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float out[Tile];
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t r0 = 0; r0 < rows; r0 += Tile) {
        const int64_t tile = std::min(Tile, rows - r0);
        row_fn(o, r0, tile, out);
        for (int64_t r = 0; r < tile; ++r) y[(r0 + r) * n + o] = from_f<T>(out[r]);
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The int8 kernel on AVX-512, for up to WIDE_TILE input rows at once: each 16 weights widened
// once (sign extension and a conversion) for every row of the tile, one 16-lane accumulator per
// row. The AVX2 kernel above, 8 lanes and 4 rows a pass, was compute-bound at ~5 ms for
// SmolLM2's output head (49152 x 576) on one row, where reading its 28 MB takes ~1 ms, and
// read the weights once per 4 rows (benchmarks/kernels.py). A row's sums run in the same order
// whatever the tile holds, so its bits do not depend on the rows beside it.
constexpr int64_t WIDE_TILE = 8;

template <int64_t R>
inline void int8_row_wide(const float* x, const int8_t* w, float scale, float* out, int64_t k) {
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
    const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    for (int64_t r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + i), wf, acc[r]);
  }
  if (i < k) {  // the tail in the same lanes, zero-padded: no scalar loop the compiler may
                // vectorize one way for one row count and another way for the next
    const __mmask16 m = static_cast<__mmask16>((1u << (k - i)) - 1);
    const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w + i)));
    for (int64_t r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + r * k + i), wf, acc[r]);
  }
  for (int64_t r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) * scale;
}

// bf16 rows: 32 weights at a time become bf16 (exact: codes are integers of at most 127) and
// meet the rows through the bf16 dot-product instruction, each product exact in float32, half
// the instructions per row of the float32 path.
template <int64_t R>
inline void int8_row_bf16(const c10::BFloat16* x, const int8_t* w, float scale, float* out,
                          int64_t k) {
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    const __m512bh wb = _mm512_cvtne2ps_pbh(hi, lo);
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_loadu_si512(x + r * k + i);
      acc[r] = _mm512_dpbf16_ps(acc[r], xr, wb);
    }
  }
  if (i < k) {  // the tail through the same instruction, zero-padded (as the float32 kernel)
    const __mmask32 m = static_cast<__mmask32>((1ull << (k - i)) - 1);
    const __m256i b = _mm256_maskz_loadu_epi8(m, w + i);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    const __m512bh wb = _mm512_cvtne2ps_pbh(hi, lo);
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * k + i);
      acc[r] = _mm512_dpbf16_ps(acc[r], xr, wb);
    }
  }
  for (int64_t r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) * scale;
}

// Rows 1..WIDE_TILE of a tile to the kernel instantiated for that many.
template <typename X, typename Kernel>
inline void int8_tile(Kernel kernel, const X* x, const int8_t* w, float scale, float* out,
                      int64_t rows, int64_t k) {
  switch (rows) {
    case 1: return kernel(std::integral_constant<int64_t, 1>{}, x, w, scale, out, k);
    case 2: return kernel(std::integral_constant<int64_t, 2>{}, x, w, scale, out, k);
    case 3: return kernel(std::integral_constant<int64_t, 3>{}, x, w, scale, out, k);
    case 4: return kernel(std::integral_constant<int64_t, 4>{}, x, w, scale, out, k);
    case 5: return kernel(std::integral_constant<int64_t, 5>{}, x, w, scale, out, k);
    case 6: return kernel(std::integral_constant<int64_t, 6>{}, x, w, scale, out, k);
    case 7: return kernel(std::integral_constant<int64_t, 7>{}, x, w, scale, out, k);
    default: return kernel(std::integral_constant<int64_t, 8>{}, x, w, scale, out, k);
  }
}
#endif

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w,
                          const torch::Tensor& scale) {
  check_tensor(x, "x", 2);
  check_float(x, "x");
  check_tensor(w, "weight", 2);
  check_tensor(scale, "scale", 1);
  TORCH_CHECK(w.scalar_type() == at::kChar, "weight must be int8, not ", w.scalar_type());
  TORCH_CHECK(scale.scalar_type() == x.scalar_type(), "scale is ", scale.scalar_type(), ", x is ",
              x.scalar_type());
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && scale.size(0) == n, "weight ", w.sizes(), " and scale ",
              scale.sizes(), " for rows of ", k);
  auto y = torch::empty({rows, n}, x.options());
  const std::vector<float> sf = widen(scale);
  const int8_t* wp = w.data_ptr<int8_t>();
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xb = x.data_ptr<c10::BFloat16>();
    const auto kernel = [](auto r, auto... args) { int8_row_bf16<decltype(r)::value>(args...); };
    weight_only_rows<c10::BFloat16, WIDE_TILE>(
        rows, n, y.data_ptr<c10::BFloat16>(),
        [&](int64_t o, int64_t r0, int64_t tile, float* out) {
          int8_tile(kernel, xb + r0 * k, wp + o * k, sf[o], out, tile, k);
        });
    return y;
  }
#endif
  const std::vector<float> xf = widen(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_linear", [&] {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const auto kernel = [](auto r, auto... args) { int8_row_wide<decltype(r)::value>(args...); };
    weight_only_rows<scalar_t, WIDE_TILE>(
        rows, n, y.data_ptr<scalar_t>(), [&](int64_t o, int64_t r0, int64_t tile, float* out) {
          int8_tile(kernel, xf.data() + r0 * k, wp + o * k, sf[o], out, tile, k);
        });
#else
    weight_only_rows<scalar_t>(rows, n, y.data_ptr<scalar_t>(),
                               [&](int64_t o, int64_t r0, int64_t tile, float* out) {
                                 int8_row(xf.data() + r0 * k, wp + o * k, sf[o], out, tile, k);
                               });
#endif
  });
  return y;
}

// The operands every packed-weight kernel takes: float rows of whole groups of 32 values, uint8
// codes and scales of the given ranks (float32 unless said).
void check_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t packed_dims,
                  const torch::Tensor& scales, const char* scales_name, int64_t scales_dims,
                  at::ScalarType scales_dtype = at::kFloat) {
  check_tensor(x, "x", 2);
  check_float(x, "x");
  check_tensor(packed, "packed", packed_dims);
  check_tensor(scales, scales_name, scales_dims);
  TORCH_CHECK(packed.scalar_type() == at::kByte, "packed must be uint8, not ",
              packed.scalar_type());
  TORCH_CHECK(scales.scalar_type() == scales_dtype, scales_name, " must be ", scales_dtype,
              ", not ", scales.scalar_type());
  TORCH_CHECK(x.size(1) % INT4_GROUP == 0, "rows of ", x.size(1),
              " values are not whole groups of 32");
}

// x @ w^T for int4 weights in inferd's row layout (inferd.layers.linear.pack_int4_rows):
// packed uint8 [n, k / 2], scales_and_mins float32 [n, k / 32, 2].
torch::Tensor int4_rows_linear(const torch::Tensor& x, const torch::Tensor& packed,
                               const torch::Tensor& scales_and_mins) {
  check_packed(x, packed, 2, scales_and_mins, "scales_and_mins", 3);
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == k, "packed ", packed.sizes(), " for rows of ", k);
  TORCH_CHECK(scales_and_mins.size(0) == n && scales_and_mins.size(1) == k / INT4_GROUP &&
                  scales_and_mins.size(2) == 2,
              "scales_and_mins ", scales_and_mins.sizes(), " for ", n, " rows of ", k);
  const int64_t groups = k / INT4_GROUP;
  auto y = torch::empty({rows, n}, x.options());
  const std::vector<float> xf = widen(x);
  std::vector<float> xsum(rows * groups, 0.f);  // sum of each group of each row: the min's term
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) xsum[r * groups + i / INT4_GROUP] += xf[r * k + i];
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sm = scales_and_mins.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int4_rows_linear", [&] {
    weight_only_rows<scalar_t>(
        rows, n, y.data_ptr<scalar_t>(), [&](int64_t o, int64_t r0, int64_t tile, float* out) {
          int4_row(xf.data() + r0 * k, xsum.data() + r0 * groups, wp + o * (k / 2),
                   sm + o * groups * 2, out, tile, k);
        });
  });
  return y;
}


// Packed low-bit weights times int8 activations (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0
// schemes), for batched decodes that are compute-bound: AVX-512 VNNI's vpdpbusd multiplies 64
// unsigned codes by 64 signed bytes and adds them in fours into 16 int32 lanes, twice the
// multiplies of vdpbf16ps per instruction, from weights read as 4 or 8 bits. Layouts
// (inferd.layers.linear.pack_int4_vnni, pack_int8_vnni): outputs in tiles of 16; for each tile
// and group of 32 inputs,
// - int4: 4 vectors of 64 bytes, byte 4 * o + i of vector p holding output o's code (0..15) of
//   input 8p + i in its low nibble and of input 8p + 4 + i in its high one; then the tile's
//   group scales and mins, float16 [tiles, groups, 2, 16] (as GGML's Q4_1 block keeps them: 40
//   bytes for 32 weights; float32 ones made the weights' bytes 1.5x their codes');
// - int8: 8 vectors of 64 bytes, byte 4 * o + i of vector p holding output o's code of input
//   4p + i plus 128 (0..254, so unsigned); then the tile's group scales, float16 [tiles, groups,
//   1, 16] (GGML's Q8_0 block: 34 bytes for 32 weights, its scale exact). The 128 comes off in
//   the integers, 128 times the sum of the row's group codes, so each group adds one exact
//   integer dot product times both scales, as llama.cpp's Q8_0 x Q8_0:
//     y[r, o] = sum_g (scale_w[o, g] * scale_x[r, g]) * idot_g.
//   (As a min term, -128 * scale_w * sum_x, the two large terms cancel, in float32.)
// Each row of x is quantized per group of 32: scale = absmax / 127, code = round-half-even(x /
// scale) (as a multiplication by the float32 reciprocal), and the sum of the quantized values
// kept for the min term (as llama.cpp's Q8_1 does):
//   y[r, o] = sum_g (scale_w[o, g] * scale_x[r, g]) * idot_g + min_w[o, g] * sum_x[r, g].
// sum_x is that of the quantized row, scale_x[r, g] * sum(codes), not of x: then the rounding
// errors meet the weights w = code * scale + min themselves, centered near 0, instead of
// code * scale, which is all positive and sums them up (benchmarks/accuracy.py on SmolLM2: mean
// KL to float32 0.0044 against 0.0148 with the float sum of x).
// summed over g in order, each step one fma per term, in float32. A row's sums do not depend on
// the rows beside it or on the threads (each task owns whole output tiles).
constexpr int64_t VNNI_TILE = 16;  // outputs per tile: one int32 lane each
constexpr int64_t VNNI_ROWS = 8;   // rows held in registers per pass over a tile

// A tile's bytes of one group, its 64-byte vectors and the halves of its scales (and mins).
template <int Bits>
struct VnniLayout {
  static_assert(Bits == 4 || Bits == 8);
  static constexpr int64_t vectors = Bits == 4 ? 4 : 8;
  static constexpr int64_t group_bytes = 64 * vectors;
  static constexpr int64_t group_scales = (Bits == 4 ? 2 : 1) * VNNI_TILE;
};
using VnniScale = c10::Half;

// A value the compiler must take as it is: under -ffast-math it would fold 1 / (amax * (1 / 127))
// into 127 / amax, other bits than the reference's reciprocal of the scale.
inline float opaque(float v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(v));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(v));
#endif
  return v;
}

// Fewer groups than this are quantized on the calling thread before a projection's threads start.
constexpr int64_t kParallelGroups = 128;

struct QuantizedRows {
  std::vector<int8_t> codes;  // [rows, k]
  std::vector<float> scale;   // [rows, groups]
  std::vector<float> sum;     // [rows, groups]: scale * the sum of the group's codes
  std::vector<int32_t> code_sum;  // [rows, groups]: the sum of the group's codes
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <typename T>
inline __m512 load16(const T* p) {  // other dtypes (double): a float32 copy first
  float f[16];
  for (int64_t i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return _mm512_loadu_ps(f);
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // a bfloat16 is the high half of a float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One group of 32 values: the scalar loop below in 16 lanes, the same roundings (the product
// by the reciprocal, round-half-even, the clamp), so the same codes.
template <typename T>
inline void quantize_group(const T* xg, int8_t* dst, float& scale_out, float& sum_out,
                           int32_t& code_sum) {
  const __m512 a = load16(xg), b = load16(xg + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float scale = opaque(amax * INV_QMAX);
  const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_min_ps(
      hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(a, inv), kNearest))));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_min_ps(
      hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(b, inv), kNearest))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qb));
  code_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  scale_out = scale;
  sum_out = scale * static_cast<float>(code_sum);
}
#else
template <typename T>
inline void quantize_group(const T* xg, int8_t* dst, float& scale_out, float& sum_out,
                           int32_t& code_sum) {
  float v[INT4_GROUP];
  float amax = 0.f;
  for (int64_t i = 0; i < INT4_GROUP; ++i) {
    v[i] = load_f(xg, i);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float scale = opaque(amax * INV_QMAX);
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < INT4_GROUP; ++i) {
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(v[i] * inv))));
    sum += dst[i];
  }
  code_sum = sum;
  scale_out = scale;
  sum_out = scale * static_cast<float>(sum);
}
#endif

// Room for rows x k codes; the vectors only grow, so a step's projections reuse one allocation.
inline void reserve(QuantizedRows& q, int64_t rows, int64_t k) {
  const auto groups = static_cast<size_t>(rows * (k / INT4_GROUP));
  if (q.codes.size() < static_cast<size_t>(rows * k)) q.codes.resize(rows * k);
  if (q.scale.size() < groups) {
    q.scale.resize(groups);
    q.sum.resize(groups);
    q.code_sum.resize(groups);
  }
}

// Groups [begin, end) of x's rows (each row's groups in turn) into q.
template <typename T>
void quantize_groups(const T* x, int64_t begin, int64_t end, QuantizedRows& q) {
  for (int64_t rg = begin; rg < end; ++rg)
    quantize_group(x + rg * INT4_GROUP, q.codes.data() + rg * INT4_GROUP, q.scale[rg], q.sum[rg],
                   q.code_sum[rg]);
}

// [begin, end) in `parts` contiguous chunks, as at::parallel_for splits a range: part `i`'s.
inline std::pair<int64_t, int64_t> chunk_of(int64_t begin, int64_t end, int64_t parts, int64_t i) {
  const int64_t size = (end - begin + parts - 1) / parts;
  const int64_t lo = std::min(end, begin + i * size);
  return {lo, std::min(end, lo + size)};
}

// first over [0, n1), then, once every thread is through it, second over [0, n2): one parallel
// region with a barrier, where two at::parallel_for calls would start the threads twice. Each
// phase hands the threads contiguous chunks, as at::parallel_for (grain 1) does. Serial where
// at::parallel_for would be: one thread, or inside a parallel region already.
template <typename First, typename Second>
void parallel_phases(int64_t n1, const First& first, int64_t n2, const Second& second) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (threads <= 1 || n2 <= 1) {
    first(0, n1);
    second(0, n2);
    return;
  }
#pragma omp parallel  // no num_threads clause: the pool ATen uses (see its ParallelOpenMP.h)
  {
    const int64_t count = omp_get_num_threads(), tid = omp_get_thread_num();
    const auto [b1, e1] = chunk_of(0, n1, count, tid);
    if (b1 < e1) first(b1, e1);
#pragma omp barrier
    const auto [b2, e2] = chunk_of(0, n2, count, tid);
    if (b2 < e2) second(b2, e2);
  }
}

// Output o's code of input j (0..31) of a group, from the group's bytes `wg`.
template <int Bits>
inline int32_t vnni_code(const uint8_t* wg, int64_t o, int64_t j) {
  if constexpr (Bits == 4) {
    const uint8_t b = wg[(j / 8) * 64 + o * 4 + j % 4];
    return (j % 8) < 4 ? (b & 0x0F) : (b >> 4);
  } else {
    return wg[(j / 4) * 64 + o * 4 + j % 4];
  }
}

// Output tile t for rows [r0, r0 + R): the reference arithmetic, lane by lane (AVX2 and other
// builds; the same float steps as the VNNI path, so the same bits).
template <int Bits>
inline void vnni_tile_generic(const uint8_t* wc, const VnniScale* sm,
                              const QuantizedRows& q,
                              int64_t r0, int64_t rows, int64_t k, float* out /*[rows][16]*/) {
  using L = VnniLayout<Bits>;
  const int64_t groups = k / INT4_GROUP;
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* xr = q.codes.data() + (r0 + r) * k;
    for (int64_t o = 0; o < VNNI_TILE; ++o) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* wg = wc + g * L::group_bytes;
        int32_t dot = 0;
        for (int64_t j = 0; j < INT4_GROUP; ++j)
          dot += vnni_code<Bits>(wg, o, j) * xr[g * INT4_GROUP + j];
        const auto* s = sm + g * L::group_scales;
        const int64_t rg = (r0 + r) * groups + g;
        if constexpr (Bits == 8) dot -= 128 * q.code_sum[rg];
        acc = std::fma(static_cast<float>(dot), static_cast<float>(s[o]) * q.scale[rg], acc);
        if constexpr (Bits == 4)
          acc = std::fma(static_cast<float>(s[VNNI_TILE + o]), q.sum[rg], acc);
      }
      out[r * VNNI_TILE + o] = acc;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
inline __m512 load_halves(const VnniScale* p) {  // 16 float16 (exact as float32)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// R rows of one output tile: a group's codes are loaded (int4: and unpacked, two nibble halves of
// each 64-byte vector) once for all R rows, each row's 4 activations broadcast to the 16 lanes.
template <int Bits, int64_t R>
inline void vnni_tile(const uint8_t* wc, const VnniScale* sm,
                      const QuantizedRows& q, int64_t r0, int64_t k, float* out,
                      const uint8_t* next_wc, const VnniScale* next_sm) {
  using L = VnniLayout<Bits>;
  const int64_t groups = k / INT4_GROUP;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int8_t* x = q.codes.data() + r0 * k;
  const float* xs = q.scale.data() + r0 * groups;
  const float* xsum = q.sum.data() + r0 * groups;
  const int32_t* isum = q.code_sum.data() + r0 * groups;
  const auto broadcast4 = [](const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  };
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wc + g * L::group_bytes;
    if (next_wc != nullptr) {  // the next tile's group, a tile's time ahead of its use
      for (int64_t p = 0; p < L::vectors; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(next_wc + g * L::group_bytes + p * 64),
                     _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next_sm + g * L::group_scales), _MM_HINT_T0);
    }
    __m512i dot[R];
    for (int64_t r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int64_t p = 0; p < L::vectors; ++p) {
      const __m512i v = _mm512_loadu_si512(wg + p * 64);
      if constexpr (Bits == 4) {
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int64_t r = 0; r < R; ++r) {
          const int8_t* xg = x + r * k + g * INT4_GROUP + p * 8;
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo, broadcast4(xg));
          dot[r] = _mm512_dpbusd_epi32(dot[r], hi, broadcast4(xg + 4));
        }
      } else {
        for (int64_t r = 0; r < R; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], v, broadcast4(x + r * k + g * INT4_GROUP + p * 4));
      }
    }
    if constexpr (Bits == 4) {
      const __m512 sw = load_halves(sm + g * L::group_scales);
      const __m512 mw = load_halves(sm + g * L::group_scales + VNNI_TILE);
      for (int64_t r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(xs[r * groups + g]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
      }
    } else {  // 16 halves (exact as float32); the codes' 128 off in the integers
      const __m512 sw = load_halves(sm + g * L::group_scales);
      for (int64_t r = 0; r < R; ++r) {
        const __m512i idot =
            _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * isum[r * groups + g]));
        const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(xs[r * groups + g]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), scale, acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(out + r * VNNI_TILE, acc[r]);
}

template <int Bits, int64_t R = VNNI_ROWS>
inline void vnni_rows(const uint8_t* wc, const VnniScale* sm,
                      const QuantizedRows& q, int64_t r0, int64_t rows, int64_t k, float* out,
                      const uint8_t* next_wc, const VnniScale* next_sm) {
  if constexpr (R > 1) {
    if (rows < R) return vnni_rows<Bits, R - 1>(wc, sm, q, r0, rows, k, out, next_wc, next_sm);
  }
  vnni_tile<Bits, R>(wc, sm, q, r0, k, out, next_wc, next_sm);
}
#endif

// A tile's `width` outputs of one row into y: a whole bf16 tile in one vector conversion rather
// than one call per output (the 49k-output head writes 49k a row). It rounds to nearest even,
// as from_f does.
template <typename T>
inline void store_tile(const float* out, T* y, int64_t width) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (width == VNNI_TILE) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                          (__m256i)(_mm512_cvtneps_pbh(_mm512_loadu_ps(out))));
      return;
    }
  }
#endif
  for (int64_t o = 0; o < width; ++o) y[o] = from_f<T>(out[o]);
}

// x @ w^T for weights in a VNNI layout of `Bits`, activations quantized to int8 per group of 32.
template <int Bits>
torch::Tensor vnni_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, int64_t n) {
  using L = VnniLayout<Bits>;
  check_packed(x, packed, 4, scales, "scales", 4, at::kHalf);
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0);
  const int64_t groups = k / INT4_GROUP;
  TORCH_CHECK(packed.size(1) == groups && packed.size(2) == L::vectors && packed.size(3) == 64,
              "packed ", packed.sizes(), " for rows of ", k, " with ", Bits, "-bit codes");
  TORCH_CHECK(scales.size(0) == tiles && scales.size(1) == groups &&
                  scales.size(2) * scales.size(3) == L::group_scales &&
                  scales.size(3) == VNNI_TILE,
              "scales ", scales.sizes(), " for packed ", packed.sizes());
  TORCH_CHECK(n > (tiles - 1) * VNNI_TILE && n <= tiles * VNNI_TILE, n,
              " outputs do not fill ", tiles, " tiles of 16");
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0) return y;
  // The rows' int8 codes, in buffers the calling thread keeps: no allocation a projection.
  // (Bound to a reference: a lambda names a thread_local as the thread running it sees it.)
  thread_local QuantizedRows codes;
  QuantizedRows& q = codes;
  reserve(q, rows, k);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* smp = scales.data_ptr<VnniScale>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "vnni_linear", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    // A few rows' groups quantize in less time than the threads take to meet at a barrier: those
    // are quantized first, on this thread; more (16 rows: ~0.6 ms a step) over the threads.
    const int64_t quantized = rows * groups < kParallelGroups ? rows * groups : 0;
    quantize_groups(xp, 0, quantized, q);
    const auto quantize = [&](int64_t begin, int64_t end) {
      quantize_groups(xp, quantized + begin, quantized + end, q);
    };
    parallel_phases(rows * groups - quantized, quantize, tiles, [&](int64_t begin, int64_t end) {
      float out[VNNI_ROWS * VNNI_TILE];
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* wc = wp + t * groups * L::group_bytes;
        const auto* sm = smp + t * groups * L::group_scales;
        const int64_t width = std::min(VNNI_TILE, n - t * VNNI_TILE);
        for (int64_t r0 = 0; r0 < rows; r0 += VNNI_ROWS) {
          const int64_t tile_rows = std::min(VNNI_ROWS, rows - r0);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
          // Past one pass of rows, the first pass over a tile prefetches the next tile (the
          // other passes read this one cached): a tile's passes take long enough for the
          // hardware prefetcher to fall behind. One pass (a decode of few rows) is left to it.
          const bool ahead = rows > VNNI_ROWS && r0 == 0 && t + 1 < end;
          vnni_rows<Bits>(wc, sm, q, r0, tile_rows, k, out,
                          ahead ? wc + groups * L::group_bytes : nullptr,
                          ahead ? sm + groups * L::group_scales : nullptr);
#else
          vnni_tile_generic<Bits>(wc, sm, q, r0, tile_rows, k, out);
#endif
          for (int64_t r = 0; r < tile_rows; ++r)
            store_tile(out + r * VNNI_TILE, yp + (r0 + r) * n + t * VNNI_TILE, width);
        }
      }
    });
  });
  return y;
}

// The index of each row's largest value, as torch.argmax(dim=-1) picks it: the first of equal
// maxima, or the first NaN of a row that holds one (NaN ranks above every number there). torch's
// CPU reduction took ~37 us a row of SmolLM2's 49k logits, 0.6 ms of a 16-row step's greedy
// sampling; this reads a row twice (its maximum, then where that value first is), rows over the
// threads. NaN is found by its bits: -ffast-math lets the compiler drop std::isnan.
inline bool is_nan_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

inline int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  best = _mm512_reduce_max_ps(top);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || is_nan_bits(x[i]);
    best = std::max(best, x[i]);
  }
  i = 0;
  if (nan) {
    while (!is_nan_bits(x[i])) ++i;
    return i;
  }
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
#endif
  while (i < n && x[i] != best) ++i;
  return i;
}

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_tensor(logits, "logits", 2);
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "logits must be float32, not ",
              logits.scalar_type());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "rows of no values have no largest");
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * n, n);
  });
  return out;
}

// ---- A decode step's decoder layers in one call ----
// Run from Python, a decoder layer of a decode step was ~9 kernel calls and ~40 us of Python
// around them (attribute reads, dtype checks, context lookups, argument conversion): ~1.2 ms of
// a 16-row SmolLM2 step (benchmarks/step_profile.py). decode_stack runs the same kernels in the
// same order on the same tensors, so every row gets the same bits, with one call for all the
// layers (models/decode_stack.py says when a step takes it). The layout of a layer, filled from
// Python once per model: Llama's pre-norm layer, or Gemma's sandwich (attn_out_norm and
// mlp_out_norm set), optional per-head q/k norms (Qwen3, Gemma 3) and a QKV bias (Qwen2).

// A projection whose weights are in a VNNI layout (int4 or int8 codes, vnni_linear).
struct StackProjection {
  torch::Tensor packed, scales;
  int64_t bits = 4, n = 0;
  std::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    auto y = bits == 4 ? vnni_linear<4>(x, packed, scales, n) : vnni_linear<8>(x, packed, scales, n);
    return bias ? y + *bias : y;  // as Linear adds it: a new tensor, rounded once
  }
};

struct StackLayer {
  torch::Tensor input_norm, mlp_norm;  // the norms each residual add runs inside
  std::optional<torch::Tensor> attn_out_norm, mlp_out_norm;  // Gemma's post-norms
  std::optional<torch::Tensor> q_norm, k_norm;
  StackProjection qkv, o, gate_up, down;
  double eps = 1e-6;
  bool unit_offset = false;  // Gemma's norms: scale by 1 + w
  bool gelu = false;         // GeGLU instead of SwiGLU
  int64_t heads = 0, kv_heads = 0;
  double scale = 1.0, softcap = 0.0;  // attention's (softcap 0: none)
  int64_t window = 0;    // sliding-window layers' keys (0: all)
  int64_t rotation = 0;  // which of the rotary tables the layer rotates with
};

// The layers on x + delta (on x when delta is None), returning (residual, delta) as the Python
// path leaves them: the next norm does the add (LlamaDecoderLayer.forward_split).
std::tuple<torch::Tensor, torch::Tensor> decode_stack(
    const std::vector<const StackLayer*>& layers, torch::Tensor x,
    std::optional<torch::Tensor> delta, const torch::Tensor& positions, const torch::Tensor& slots,
    const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& signed_sin,
    const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
    const torch::Tensor& block_tables, const torch::Tensor& lens) {
  const auto count = static_cast<int64_t>(layers.size());
  TORCH_CHECK(count > 0, "no layers to run");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == count &&
                  static_cast<int64_t>(v_caches.size()) == count,
              count, " layers over ", k_caches.size(), " K and ", v_caches.size(), " V caches");
  TORCH_CHECK(cos.size() == signed_sin.size(), cos.size(), " cos tables and ", signed_sin.size(),
              " sin tables");
  check_tensor(x, "x", 2);
  const int64_t n = x.size(0);
  for (int64_t i = 0; i < count; ++i) {
    const StackLayer& layer = *layers[i];
    TORCH_CHECK(layer.rotation >= 0 && layer.rotation < static_cast<int64_t>(cos.size()),
                "layer ", i, " rotates with table ", layer.rotation, " of ", cos.size());
    torch::Tensor h;
    if (delta) {
      std::tie(x, h) = add_rms_norm(x, *delta, layer.input_norm, layer.eps, layer.unit_offset);
    } else {
      h = rms_norm(x, layer.input_norm, layer.eps, layer.unit_offset);
    }
    auto qkv = layer.qkv(h);
    if (layer.q_norm && layer.k_norm)
      qkv = qk_rms_norm(qkv, *layer.q_norm, *layer.k_norm, layer.heads, layer.kv_heads, layer.eps,
                        layer.unit_offset);
    const auto q = rope_write_kv(qkv, positions, slots, cos[layer.rotation],
                                 signed_sin[layer.rotation], k_caches[i], v_caches[i], layer.heads);
    const auto attn = decode_attention(q, k_caches[i], v_caches[i], block_tables, lens,
                                       layer.scale, layer.softcap, layer.window);
    auto o = layer.o(attn.view({n, -1}));
    if (layer.attn_out_norm) o = rms_norm(o, *layer.attn_out_norm, layer.eps, layer.unit_offset);
    std::tie(x, h) = add_rms_norm(x, o, layer.mlp_norm, layer.eps, layer.unit_offset);
    const auto gate_up = layer.gate_up(h);
    auto d = layer.down(layer.gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up));
    if (layer.mlp_out_norm) d = rms_norm(d, *layer.mlp_out_norm, layer.eps, layer.unit_offset);
    delta = d;
  }
  return {x, *delta};
}

}  // namespace

// The GIL is released while a kernel runs, as torch's own ops do, so the server's other
// thread can stream tokens meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm", &rms_norm, release(), py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("unit_offset") = false);
  m.def("add_rms_norm", &add_rms_norm, release(), py::arg("x"), py::arg("delta"),
        py::arg("weight"), py::arg("eps"), py::arg("unit_offset") = false);
  m.def("qk_rms_norm", &qk_rms_norm, release());
  m.def("rope_write_kv", &rope_write_kv, release());
  m.def("decode_attention", &decode_attention, release(), py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("lens"), py::arg("scale"),
        py::arg("softcap"), py::arg("window"), py::arg("grouped") = true);
  m.def("silu_mul", &silu_mul, release());
  m.def("gelu_tanh_mul", &gelu_tanh_mul, release());
  m.def("int8_linear", &int8_linear, release());
  m.def("int4_rows_linear", &int4_rows_linear, release());
  m.def("int4_vnni_linear", &vnni_linear<4>, release());
  m.def("int8_vnni_linear", &vnni_linear<8>, release());
  m.def("argmax_rows", &argmax_rows, release());
  py::class_<StackProjection>(m, "StackProjection")
      .def(py::init<>())
      .def_readwrite("packed", &StackProjection::packed)
      .def_readwrite("scales", &StackProjection::scales)
      .def_readwrite("bits", &StackProjection::bits)
      .def_readwrite("n", &StackProjection::n)
      .def_readwrite("bias", &StackProjection::bias);
  py::class_<StackLayer>(m, "StackLayer")
      .def(py::init<>())
      .def_readwrite("input_norm", &StackLayer::input_norm)
      .def_readwrite("mlp_norm", &StackLayer::mlp_norm)
      .def_readwrite("attn_out_norm", &StackLayer::attn_out_norm)
      .def_readwrite("mlp_out_norm", &StackLayer::mlp_out_norm)
      .def_readwrite("q_norm", &StackLayer::q_norm)
      .def_readwrite("k_norm", &StackLayer::k_norm)
      .def_readwrite("qkv", &StackLayer::qkv)
      .def_readwrite("o", &StackLayer::o)
      .def_readwrite("gate_up", &StackLayer::gate_up)
      .def_readwrite("down", &StackLayer::down)
      .def_readwrite("eps", &StackLayer::eps)
      .def_readwrite("unit_offset", &StackLayer::unit_offset)
      .def_readwrite("gelu", &StackLayer::gelu)
      .def_readwrite("heads", &StackLayer::heads)
      .def_readwrite("kv_heads", &StackLayer::kv_heads)
      .def_readwrite("scale", &StackLayer::scale)
      .def_readwrite("softcap", &StackLayer::softcap)
      .def_readwrite("window", &StackLayer::window)
      .def_readwrite("rotation", &StackLayer::rotation);
  m.def("decode_stack", &decode_stack, release(), py::arg("layers"), py::arg("x"),
        py::arg("delta"), py::arg("positions"), py::arg("slots"), py::arg("cos"),
        py::arg("signed_sin"), py::arg("k_caches"), py::arg("v_caches"),
        py::arg("block_tables"), py::arg("lens"));
}
