// Fused per-row operations of the target's decoder layers on a CPU in bf16
// (docs/DESIGN.md, "CPU performance"). Each replaces 5-15 small ATen operations of a layer.
//
// Exactness: every output row is computed from its own input row by the same code whatever
// the number of rows, the batch or the thread that runs it, and the file is built without
// -ffast-math and with -ffp-contract=off, so the compiler keeps each floating-point operation
// as written (vectorised or not, the results are the same). Sums run in a fixed order: 16
// partial sums, element h into partial h % 16, then the partials pairwise. So a token gets
// bitwise the same result decoded alone or as a node of a verified tree, which exact bf16
// verification needs (docs/DESIGN.md, "Exact bf16 attention").
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using bf16 = c10::BFloat16;

inline float sum_squares(const bf16* x, int64_t n) {
  float part[16] = {0.f};
  int64_t h = 0;
  for (; h + 16 <= n; h += 16)
    for (int l = 0; l < 16; ++l) {
      const float f = static_cast<float>(x[h + l]);
      part[l] += f * f;
    }
  for (int l = 0; h + l < n; ++l) {
    const float f = static_cast<float>(x[h + l]);
    part[l] += f * f;
  }
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) part[l] += part[l + width];
  return part[0];
}

// out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w) (the Llama RMSNorm: normalise in fp32,
// round, scale by the bf16 weight)
inline void norm_row(const bf16* x, const bf16* w, float eps, int64_t n, bf16* out) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t h = 0; h < n; ++h) {
    const float normed = static_cast<float>(bf16(static_cast<float>(x[h]) * inv));
    out[h] = bf16(normed * static_cast<float>(w[h]));
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "expected a contiguous bf16 CPU tensor");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 1 &&
                  w.size(0) == x.size(-1), "norm weight must be bf16 [H]");
}

}  // namespace

// x [..., H] -> RMSNorm(x) [..., H]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, w);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  auto out = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * n, wp, static_cast<float>(eps), n,
                                               op + r * n);
  });
  return out;
}

// x, delta [..., H] -> (s = bf16(x + delta), RMSNorm(s)): a residual add and the next norm
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& delta,
                                                      const torch::Tensor& w, double eps) {
  check_rows(x, w);
  check_rows(delta, w);
  TORCH_CHECK(x.sizes() == delta.sizes(), "x and delta differ in shape");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* dp = delta.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* sp = sum.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t h = 0; h < n; ++h)
        sp[r * n + h] = bf16(static_cast<float>(xp[r * n + h]) +
                             static_cast<float>(dp[r * n + h]));
      norm_row(sp + r * n, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
  return {sum, out};
}

// qkv [B, N, (Hq + 2 KVH) Dh] (one fused projection's output), cos/sin [B, N, Dh]: RoPE
// (rotate-half) on q and k in fp32, rounded once; k and v written into one layer's cache
// (cache_k [slots, KVH, S, Dh], cache_v [slots, KVH, S, >= Dh]) at (slots[b], write_pos[b, n]);
// -> q [B, Hq, N, Dh].
torch::Tensor qkv_rope_write(const torch::Tensor& qkv, const torch::Tensor& cos,
                             const torch::Tensor& sin, int64_t num_q, int64_t num_kv,
                             torch::Tensor cache_k, torch::Tensor cache_v,
                             const torch::Tensor& slots, const torch::Tensor& write_pos) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous() && qkv.dim() == 3,
              "qkv must be a contiguous bf16 [B, N, (Hq + 2 KVH) Dh]");
  const int64_t B = qkv.size(0), N = qkv.size(1);
  const int64_t dh = qkv.size(2) / (num_q + 2 * num_kv), half = dh / 2;
  TORCH_CHECK(dh * (num_q + 2 * num_kv) == qkv.size(2) && dh % 2 == 0, "head sizes");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * N * dh &&
                  sin.numel() == B * N * dh, "cos/sin must be contiguous bf16 [B, N, Dh]");
  TORCH_CHECK(cache_k.scalar_type() == at::kBFloat16 && cache_v.scalar_type() == at::kBFloat16 &&
                  cache_k.dim() == 4 && cache_v.dim() == 4 && cache_k.size(3) == dh &&
                  cache_v.size(3) >= dh && cache_k.stride(3) == 1 && cache_v.stride(3) == 1 &&
                  cache_k.size(1) == num_kv, "cache layer views");
  auto sl = slots.to(at::kLong).contiguous();
  auto wpos = write_pos.to(at::kLong).contiguous();
  TORCH_CHECK(sl.numel() == B && wpos.numel() == B * N, "slots [B], write_pos [B, N]");
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* wpp = wpos.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i)
    TORCH_CHECK(slp[i] >= 0 && slp[i] < cache_k.size(0), "slot out of range");
  for (int64_t i = 0; i < B * N; ++i)
    TORCH_CHECK(wpp[i] >= 0 && wpp[i] < cache_k.size(2), "cache position out of range");
  auto q = torch::empty({B, num_q, N, dh}, qkv.options());
  const bf16* src = qkv.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  bf16* kp = cache_k.data_ptr<bf16>();
  bf16* vp = cache_v.data_ptr<bf16>();
  const auto ks = cache_k.strides();
  const auto vs = cache_v.strides();
  const int64_t heads = num_q + 2 * num_kv;
  at::parallel_for(0, B * N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / N, n = r % N;
      const bf16* row = src + r * heads * dh;
      const bf16* c = cp + r * dh;
      const bf16* s = sp + r * dh;
      for (int64_t h = 0; h < num_q + num_kv; ++h) {
        const bf16* x = row + h * dh;
        bf16* dst = h < num_q
            ? qp + ((b * num_q + h) * N + n) * dh
            : kp + slp[b] * ks[0] + (h - num_q) * ks[1] + wpp[r] * ks[2];
        for (int64_t d = 0; d < dh; ++d) {
          const float rot = d < half ? -static_cast<float>(x[d + half])
                                     : static_cast<float>(x[d - half]);
          const float a = static_cast<float>(x[d]) * static_cast<float>(c[d]);
          const float bsin = rot * static_cast<float>(s[d]);
          dst[d] = bf16(a + bsin);
        }
      }
      for (int64_t h = 0; h < num_kv; ++h) {
        const bf16* x = row + (num_q + num_kv + h) * dh;
        bf16* dst = vp + slp[b] * vs[0] + h * vs[1] + wpp[r] * vs[2];
        for (int64_t d = 0; d < dh; ++d) dst[d] = x[d];
      }
    }
  });
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (bf16, fixed order)");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm (bf16, fixed order)");
  m.def("qkv_rope_write", &qkv_rope_write, "RoPE on q and k, k and v into the cache (bf16)");
}
