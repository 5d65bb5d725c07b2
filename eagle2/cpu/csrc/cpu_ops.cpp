// Fused per-row operations of the target's decoder layers on a CPU in bf16
// (docs/cpu-backend.md, "CPU performance"). Each replaces 5-15 small ATen operations of a layer.
//
// Exactness: every output row is computed from its own input row by the same code whatever
// the number of rows, the batch or the thread that runs it, and the file is built without
// -ffast-math and with -ffp-contract=off, so the compiler keeps each floating-point operation
// as written (vectorised or not, the results are the same). Sums run in a fixed order: 16
// partial sums, element h into partial h % 16, then the partials pairwise. So a token gets
// bitwise the same result decoded alone or as a node of a verified tree, which exact bf16
// verification needs (docs/cpu-backend.md, "Exact bf16 attention").
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Two instruction sets: AVX-512 with bf16 dot products (AVX512-BF16), or AVX2 with FMA (every
// x86-64 CPU since about 2015). With AVX2 the same operations run on 8 fp32 lanes; the bf16
// dot-product linear (`linear`) needs AVX512-BF16 and reports that it is not available.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define EAGLE2_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define EAGLE2_AVX2 1
#else
#error "eagle2's fused CPU operations need AVX2 and FMA, or AVX512-BF16"
#endif

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

// rows a task of the row-wise operators below takes: enough that a second thread pays for its
// share (~4K elements; a region costs ~1-2 us where the thread is awake, `import eagle2`'s
// bounded spin), so the 4-16 rows of a verified tree split over the threads and a decode
// step's one row stays on the caller's
inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1));
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "expected a contiguous bf16 CPU tensor");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 1 &&
                  w.size(0) == x.size(-1), "norm weight must be bf16 [H]");
}

// Where a layer's cache entries lie (docs/kv-cache.md "Paged cache"). Slotted (no block
// tables): cache [slots, KVH, S, Dh], slot s's position j at [s, :, j]. Paged: cache
// [blocks, KVH, page, Dh], slot s's position j at entry j % page of block
// tables[s, j / page] (`KVCache.block_tables`, FlashInfer's "HND" layout).
struct Pages {
  torch::Tensor held;  // the tables as a contiguous int64 tensor (what `tables` points into)
  const int64_t* tables = nullptr;  // nullptr: slotted
  int64_t width = 0, page = 0, slots = 0, blocks = 0;  // entries a table; a block's; rows

  Pages(const std::optional<torch::Tensor>& block_tables, const torch::Tensor& cache_k) {
    blocks = cache_k.size(0);
    if (!block_tables.has_value()) {
      slots = blocks;
      page = cache_k.size(2);  // one slot's whole row
      return;
    }
    held = block_tables->to(at::kLong).contiguous();
    TORCH_CHECK(held.dim() == 2, "block_tables must be [slots, blocks a slot]");
    tables = held.data_ptr<int64_t>();
    width = held.size(1);
    page = cache_k.size(2);
    slots = held.size(0);
  }
  bool paged() const { return tables != nullptr; }
  // the most entries a slot holds
  int64_t capacity() const { return paged() ? width * page : page; }
  // slot s's block holding its position j (slotted: s itself); checked against the cache
  int64_t block(int64_t s, int64_t j) const {
    if (!paged()) return s;
    const int64_t b = tables[s * width + j / page];
    TORCH_CHECK(b >= 0 && b < blocks, "block table entry ", b, " out of range (", blocks,
                " blocks)");
    return b;
  }
  // entries [0, n) of slot s are in the cache: its row or table, and each block it names
  void check(int64_t s, int64_t n) const {
    TORCH_CHECK(s >= 0 && s < slots && n <= capacity(), "slot ", s, " or cache length ", n,
                " out of range");
    if (paged())
      for (int64_t i = 0; i * page < n; ++i) block(s, i * page);
  }
};

}  // namespace

// x [..., H] -> RMSNorm(x) [..., H]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, w);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  auto out = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
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
  at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
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
// block_tables: a paged cache (`Pages`: cache_k [blocks, KVH, page, Dh]).
torch::Tensor qkv_rope_write(const torch::Tensor& qkv, const torch::Tensor& cos,
                             const torch::Tensor& sin, int64_t num_q, int64_t num_kv,
                             torch::Tensor cache_k, torch::Tensor cache_v,
                             const torch::Tensor& slots, const torch::Tensor& write_pos,
                             const std::optional<torch::Tensor>& block_tables) {
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
  const Pages pages(block_tables, cache_k);
  // each row's entry: its block (slotted: the slot) and position in it
  std::vector<int64_t> where(static_cast<size_t>(2 * B * N));
  for (int64_t i = 0; i < B; ++i)
    TORCH_CHECK(slp[i] >= 0 && slp[i] < pages.slots, "slot out of range");
  for (int64_t i = 0; i < B * N; ++i) {
    TORCH_CHECK(wpp[i] >= 0 && wpp[i] < pages.capacity(), "cache position out of range");
    where[2 * i] = pages.block(slp[i / N], wpp[i]);
    where[2 * i + 1] = wpp[i] % pages.page;
  }
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
  at::parallel_for(0, B * N, row_grain(heads * dh), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / N, n = r % N;
      const bf16* row = src + r * heads * dh;
      const bf16* c = cp + r * dh;
      const bf16* s = sp + r * dh;
      for (int64_t h = 0; h < num_q + num_kv; ++h) {
        const bf16* x = row + h * dh;
        bf16* dst = h < num_q
            ? qp + ((b * num_q + h) * N + n) * dh
            : kp + where[2 * r] * ks[0] + (h - num_q) * ks[1] + where[2 * r + 1] * ks[2];
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
        bf16* dst = vp + where[2 * r] * vs[0] + h * vs[1] + where[2 * r + 1] * vs[2];
        for (int64_t d = 0; d < dh; ++d) dst[d] = x[d];
      }
    }
  });
  return q;
}

// ---- AMX tiles (Intel Xeon 4th generation and later): their configuration and the OS's
// permission, for the linear, the attention's scores and the greedy argmax's int8 pass ----
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && \
    defined(EAGLE2_AVX512)
#define EAGLE2_AMX 1
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0 (and tmm1 where inputs = 2): a group of input rows (rows x 64 bytes); the rest of
// tmm1-3: weight tiles (16 x 64 bytes); tmm4-7: sums (rows x 16 fp32 or int32)
inline void configure_tiles(int rows, int inputs = 1) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t)
    cfg.rows[t] = static_cast<uint8_t>(t < inputs ? rows : 16), cfg.colsb[t] = 64;
  for (int t = 4; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

bool request_amx() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

#endif

// 1 where this build has the AMX tiles and the OS lets the process use them
bool amx_ready() {
#ifdef EAGLE2_AMX
  static const bool ready = request_amx();
  return ready;
#else
  return false;
#endif
}

namespace {

constexpr int kMaxG = 8;  // query heads per KV head handled together

// whether the attention of heads of dh dimensions scores and sums on the AMX tiles (the same
// for every call of a process): then its committed values can be kept as tiles too
inline bool attention_on_tiles(int64_t dh) {
#ifdef EAGLE2_AMX
  return dh % 32 == 0 && amx_ready();
#else
  (void)dh;
  return false;
#endif
}

// One (request, KV head) of an attention call: its queries (each with G heads), its part of
// the cache, its tree mask rows.
struct Unit {
  const bf16* q;  // query n, head g (of the G): q + (g N + n) dh
  int64_t N;
  // slotted: the cache at position 0 of this slot and KV head, positions ks / vs apart; paged:
  // this KV head's entry 0 of block 0, position j at entry j % page of block table[j / page]
  // (blocks kb / vb apart)
  const bf16* k;
  const bf16* v;
  int64_t ks, vs;
  int64_t len, T;  // committed keys; tree entries (at positions len + m)
  const bool* mask;  // [N, T]: the tree entries query n attends to (its ancestors and itself)
  bf16* out;  // query n, head g: out + n out_stride + g dh
  int64_t out_stride;
  int G;
  int64_t dh;
  float scale;
  // the first `kept` blocks of W committed keys, transposed by an earlier call and kept in
  // the cache's key blocks (`update_key_blocks`, `update_page_blocks`); nullptr: every
  // committed key is transposed into the scratch. Slotted: this unit's, consecutive; paged:
  // this KV head's in block 0, a block's `block_words` apart
  const uint32_t* blocks = nullptr;
  int64_t kept = 0;
  const int64_t* table = nullptr;  // paged: the request's block table; nullptr: slotted
  int64_t page = 0, kb = 0, vb = 0;
  int64_t page_blocks = 0, block_words = 0;  // paged: key blocks a page; uint32 a block's

  const bf16* key(int64_t j) const {
    return table == nullptr ? k + j * ks : k + table[j / page] * kb + (j % page) * ks;
  }
  const bf16* value(int64_t j) const {
    return table == nullptr ? v + j * vs : v + table[j / page] * vb + (j % page) * vs;
  }
  // kept block i (i < kept) of `words` uint32 (dh / 2 * W)
  const uint32_t* kept_block(int64_t i, int64_t words) const {
    if (table == nullptr) return blocks + i * words;
    return blocks + table[i / page_blocks] * block_words + (i % page_blocks) * words;
  }
  // the first `vkept` chunks of 32 committed values as AMX tiles (`pack_value_chunk`), kept
  // in the cache's key blocks after the keys (`update_value_chunks`); nullptr: packed anew
  const uint32_t* vblocks = nullptr;
  int64_t vkept = 0;
};

// per-thread buffers, reused across units
struct Scratch {
  std::vector<uint32_t> kc, kt;  // transposed committed keys, tree entries
  std::vector<float> qe, qo, s, ts, total, sums;
  std::vector<bf16> qb;  // the queries as bf16 rows, for the AMX scores
  std::vector<bf16> pb;  // the probabilities' numerators as bf16 rows (AMX value sums)
  std::vector<uint32_t> vc, vt;  // values as VNNI tiles: committed chunks, a group's own ones
  std::vector<float> acc;  // per query row its dh fp32 sums (AMX value sums)
  std::vector<int64_t> order, lead;  // positions by their entry count; a position's group
  std::vector<const bf16*> values, tree;
  std::vector<const uint32_t*> kp;  // the key blocks scored, in order
  std::vector<int64_t> counts;
};

// exp(x) for a vector of floats (exp16, exp8 below: the same operations at both widths):
// x = n ln2 + r, |r| <= ln2 / 2, 2^n exp(r) with a degree-6 polynomial (Cephes' expf
// coefficients). Only IEEE operations with explicit FMAs, so every lane gives the same bits
// whatever the other lanes hold. x <= 0 here (scores minus their maximum).
constexpr float kExpLowest = -87.3f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = hi + lo
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef EAGLE2_AVX512
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLowest));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 32 bf16 -> two halves of 16 floats
inline void widen(const bf16* p, __mmask32 mask, __m512* lo, __m512* hi) {
  const __m512i raw = _mm512_maskz_loadu_epi16(mask, p);
  *lo = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
  *hi = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
}

inline __mmask32 chunk_mask(int64_t left) {
  return left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << left) - 1);
}



// The attention's key blocks at 16 lanes (`Lanes` below; the scores they serve are defined
// after its #endif).

// 16 bf16 pairs (uint32 lanes, first element in the low half) -> the first elements and the
// second ones as floats (exact: a bf16 is the top half of an fp32): a shift and a mask
inline void split_pairs(__m512i raw, __m512* first, __m512* second) {
  *first = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  *second = _mm512_castsi512_ps(
      _mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// count (<= 16) keys of `pairs` bf16 pairs each -> a block at blk; lanes past count are zeros
inline void transpose_keys(const bf16* const* keys, int count, int64_t pairs, uint32_t* blk) {
  for (int64_t c0 = 0; c0 < pairs; c0 += 16) {
    const int64_t rows = std::min<int64_t>(16, pairs - c0);
    const __mmask16 m = static_cast<__mmask16>((1u << rows) - 1);
    __m512i r[16], t[16], u[16], v[16];
    for (int l = 0; l < 16; ++l)
      r[l] = l < count ? _mm512_maskz_loadu_epi32(
                             m, reinterpret_cast<const uint32_t*>(keys[l]) + c0)
                       : _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 4; ++j) {
        v[8 * i + j] = _mm512_shuffle_i32x4(u[8 * i + j], u[8 * i + 4 + j], 0x88);
        v[8 * i + 4 + j] = _mm512_shuffle_i32x4(u[8 * i + j], u[8 * i + 4 + j], 0xdd);
      }
    for (int j = 0; j < 8 && j < rows; ++j)  // row j: pair c0 + j of every key
      _mm512_storeu_si512(blk + (c0 + j) * 16, _mm512_shuffle_i32x4(v[j], v[8 + j], 0x88));
    for (int j = 8; j < rows; ++j)
      _mm512_storeu_si512(blk + (c0 + j) * 16, _mm512_shuffle_i32x4(v[j - 8], v[j], 0xdd));
  }
}


// The attention's vector operations at the build's width (W fp32 lanes); the functions after
// the #endif are written once against them. AVX-512: 16 lanes, 32 registers.
struct Lanes {
  static constexpr int W = 16;
  // queries scored together and key blocks a pass: 6 x 2 x 2 sums = 24 accumulators
  static constexpr int kScoreQueries = 6;
  template <int QN>
  static constexpr int kScoreBlocks = QN >= 4 ? 2 : QN == 3 ? 3 : 4;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }  // a NaN in a: b
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static __mmask16 first(int64_t n) {
    return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  }
  // lanes [0, n) from p, the others from fill
  static F load_first(const float* p, int64_t n, F fill) {
    return _mm512_mask_loadu_ps(fill, first(n), p);
  }
  static F keep_first(F v, int64_t n) { return _mm512_maskz_mov_ps(first(n), v); }
  static void store_first(float* p, F v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
  // W bf16 pairs (n of them, the rest zeros) -> their first and second elements
  static void pairs(const uint32_t* p, F* a, F* b) { split_pairs(_mm512_loadu_si512(p), a, b); }
  static void pairs_first(const uint32_t* p, int64_t n, F* a, F* b) {
    split_pairs(_mm512_maskz_loadu_epi32(first(n), p), a, b);
  }
  static F exp(F x) { return exp16(x); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static void transpose(const bf16* const* keys, int count, int64_t pairs, uint32_t* blk) {
    transpose_keys(keys, count, pairs, blk);
  }
};


#else  // EAGLE2_AVX2: the same operations on 8 fp32 lanes, products by fp32 FMAs

inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpLowest));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 bf16 -> 8 floats (exact)
inline __m256 widen8(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// lanes [0, left) set
inline __m256i tail_mask8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// AVX2: the same operations on 8 lanes, 16 registers (fewer accumulators a pass).
struct Lanes {
  static constexpr int W = 8;
  // 4 queries x 1 block x 2 sums = 8 accumulators (2 queries x 2 blocks, fewer broadcasts
  // a key vector: ~3% slower on the Xeon)
  static constexpr int kScoreQueries = 4;
  template <int QN>
  static constexpr int kScoreBlocks = QN >= 3 ? 1 : 2;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }  // a NaN in a: b
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F load_first(const float* p, int64_t n, F fill) {
    const __m256i m = tail_mask8(n);
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
  }
  static F keep_first(F v, int64_t n) {
    return _mm256_and_ps(_mm256_castsi256_ps(tail_mask8(n)), v);
  }
  static void store_first(float* p, F v, int64_t n) { _mm256_maskstore_ps(p, tail_mask8(n), v); }
  static void split(__m256i raw, F* a, F* b) {
    *a = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *b = _mm256_castsi256_ps(
        _mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void pairs(const uint32_t* p, F* a, F* b) {
    split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), a, b);
  }
  static void pairs_first(const uint32_t* p, int64_t n, F* a, F* b) {
    if (n >= 8) return pairs(p, a, b);
    split(_mm256_maskload_epi32(reinterpret_cast<const int*>(p), tail_mask8(n)), a, b);
  }
  static F exp(F x) { return exp8(x); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // count (<= 8) keys of `pairs` bf16 pairs each -> a block [pairs][8] at blk (lanes past
  // count zeros): 8 x 8 transposes of 32-bit lanes
  static void transpose(const bf16* const* keys, int count, int64_t pairs, uint32_t* blk) {
    for (int64_t c0 = 0; c0 < pairs; c0 += 8) {
      const int64_t rows = std::min<int64_t>(8, pairs - c0);
      const __m256i m = tail_mask8(rows);
      __m256i r[8], t[8], u[8];
      for (int l = 0; l < 8; ++l)
        r[l] = l < count ? _mm256_maskload_epi32(reinterpret_cast<const int*>(keys[l]) + c0, m)
                         : _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {  // per 128-bit half: (a0 b0 a1 b1), (a2 b2 a3 b3)
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {  // (a0 b0 c0 d0), (a1 b1 c1 d1), (a2 ...), (a3 ...)
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      for (int j = 0; j < 4; ++j) {  // pair j: low halves of keys a-d and e-h; j + 4: high
        if (j < rows)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk + (c0 + j) * 8),
                              _mm256_permute2x128_si256(u[j], u[4 + j], 0x20));
        if (j + 4 < rows)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk + (c0 + j + 4) * 8),
                              _mm256_permute2x128_si256(u[j], u[4 + j], 0x31));
      }
    }
  }
};


#endif

// The exact attention on W = Lanes::W lanes. Keys are transposed in blocks of W: a block is
// [dh / 2][W] uint32, row i lane l the bf16 pair (key_l[2i], key_l[2i + 1]) (`Lanes::transpose`).
// The score of query q and key k: two fp32 sums from zero, e += q[2i] k[2i] and o += q[2i + 1]
// k[2i + 1] by FMAs in order i = 0, 1, ..., then scale * (e + o): a function of q and that key
// alone, whatever block, lane or other queries it is computed with (and the same bits at both
// widths). One widened key row serves every query of a (request, KV head), so a tree's
// queries cost FMAs only (`vdpbf16ps`, which summed one query's pairs before, runs at under
// half the FMAs' rate on the Xeon without AMX; AVX2 had widened every key for every query and
// reduced 8 lanes per score: 3x the AVX-512 kernel's time on the same CPU, now ~2x).
using V = Lanes;
constexpr int W = Lanes::W;

// s[q][W b + l] = score of query q (its even / odd dimensions as floats: qe, qo [QN][pairs])
// and lane l of block b < NB (block b at blk[b]), q < QN; rows `stride` apart
template <int QN, int NB>
inline void score_blocks(const float* qe, const float* qo, int64_t pairs,
                         const uint32_t* const* blk, float scale, float* s, int64_t stride) {
  V::F e[QN][NB], o[QN][NB];
  for (int q = 0; q < QN; ++q)
    for (int b = 0; b < NB; ++b) e[q][b] = o[q][b] = V::zero();
  for (int64_t i = 0; i < pairs; ++i) {
    V::F ke[NB], ko[NB];
    for (int b = 0; b < NB; ++b) V::pairs(blk[b] + i * W, &ke[b], &ko[b]);
    for (int q = 0; q < QN; ++q) {
      const V::F a = V::set1(qe[q * pairs + i]), c = V::set1(qo[q * pairs + i]);
      for (int b = 0; b < NB; ++b) {
        e[q][b] = V::fma(a, ke[b], e[q][b]);
        o[q][b] = V::fma(c, ko[b], o[q][b]);
      }
    }
  }
  const V::F sc = V::set1(scale);
  for (int q = 0; q < QN; ++q)
    for (int b = 0; b < NB; ++b)
      V::store(s + q * stride + W * b, V::mul(V::add(e[q][b], o[q][b]), sc));
}

// QN queries against nblk blocks: NB blocks at a time, then one
template <int QN>
void score_group(const float* qe, const float* qo, int64_t pairs, const uint32_t* const* blk,
                 int64_t nblk, float scale, float* s, int64_t stride) {
  constexpr int NB = V::kScoreBlocks<QN>;
  int64_t b = 0;
  for (; b + NB <= nblk; b += NB)
    score_blocks<QN, NB>(qe, qo, pairs, blk + b, scale, s + W * b, stride);
  for (; b < nblk; ++b)
    score_blocks<QN, 1>(qe, qo, pairs, blk + b, scale, s + W * b, stride);
}

// score_group for count (1 <= count <= QN) queries
template <int QN = V::kScoreQueries>
void score_group_of(int count, const float* qe, const float* qo, int64_t pairs,
                    const uint32_t* const* blk, int64_t nblk, float scale, float* s,
                    int64_t stride) {
  if constexpr (QN > 1) {
    if (count < QN)
      return score_group_of<QN - 1>(count, qe, qo, pairs, blk, nblk, scale, s, stride);
  }
  score_group<QN>(qe, qo, pairs, blk, nblk, scale, s, stride);
}

// nq queries (rows of qe, qo) against nblk blocks (block b at blk[b]: the committed keys'
// lie in the cache's kept blocks, a page's apart from the next page's, and in the scratch)
// -> score rows `stride` apart, kScoreQueries at a time
void score_queries(const float* qe, const float* qo, int64_t nq, int64_t pairs,
                   const uint32_t* const* blk, int64_t nblk, float scale, float* s,
                   int64_t stride) {
  for (int64_t q0 = 0; q0 < nq; q0 += V::kScoreQueries)
    score_group_of(static_cast<int>(std::min<int64_t>(V::kScoreQueries, nq - q0)),
                   qe + q0 * pairs, qo + q0 * pairs, pairs, blk, nblk, scale, s + q0 * stride,
                   stride);
}

#ifdef EAGLE2_AMX
// score_queries on the AMX tiles: nq query rows (bf16, dh apart at qb) against nblk key blocks
// ([dh / 2][16] uint32: a block is dh / 32 VNNI B tiles of 16 pair rows), up to 16 rows a tile
// multiply, two blocks at a time. A score is the tile unit's fp32 sum of the query's and the
// key's products, 32 dimensions a TDPBF16PS in dimension order from zero, then times scale: a
// function of the query and the key alone, whatever block, lane or other rows come with it
// (so a tree node and plain decoding still get the same bits), but not the FMA kernel's
// bits (its two chains of even and odd dimensions). Where the tiles exist every attention
// call scores this way, prefills, decoding and trees alike. tmm0 / tmm1: the rows' 32
// dimensions for the first / second block, tmm2 / tmm3: the blocks' tiles, tmm4 / tmm5: sums
void score_queries_amx(const bf16* qb, int64_t nq, int64_t dh, const uint32_t* const* blk,
                       int64_t nblk, float scale, float* s, int64_t stride) {
  alignas(64) float part[2][16][16];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t q0 = 0; q0 < nq; q0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, nq - q0));
    configure_tiles(rows, 2);
    const bf16* a = qb + q0 * dh;
    for (int64_t b = 0; b < nblk; b += 2) {
      const int nb = b + 1 < nblk ? 2 : 1;
      const uint32_t* k0 = blk[b];
      const uint32_t* k1 = nb == 2 ? blk[b + 1] : k0;
      _tile_zero(4);
      _tile_zero(5);
      for (int64_t d = 0; d < dh; d += 32) {  // 32 dimensions = 16 pair rows a tile
        _tile_loadd(0, a + d, dh * 2);
        _tile_loadd(2, k0 + d / 2 * W, W * 4);
        _tile_dpbf16ps(4, 0, 2);
        if (nb == 2) {
          _tile_loadd(1, a + d, dh * 2);
          _tile_loadd(3, k1 + d / 2 * W, W * 4);
          _tile_dpbf16ps(5, 1, 3);
        }
      }
      _tile_stored(4, part[0], 64);
      if (nb == 2) _tile_stored(5, part[1], 64);
      for (int t = 0; t < nb; ++t)
        for (int m = 0; m < rows; ++m)
          _mm512_storeu_ps(s + (q0 + m) * stride + W * (b + t),
                           _mm512_mul_ps(_mm512_load_ps(part[t][m]), sc));
    }
  }
  _tile_release();
}
#endif

// max of s[j], j < L (-inf for none; a NaN is passed over, as std::max(top, s[j]) in order
// passes it over). A max is exact in any order (of two zeros it may keep either sign, which
// s[j] - max cannot tell apart), so W lanes take it: the scalar loop was a chain of
// dependent vmaxss, ~23% of the attention's time at 2,000 keys.
inline float max_of(const float* s, int64_t L) {
  const V::F none = V::set1(-INFINITY);
  V::F top = none;
  for (int64_t j = 0; j < L; j += W) top = V::max(V::load_first(s + j, L - j, none), top);
  alignas(64) float lanes[W];
  V::store(lanes, top);
  float best = -INFINITY;
  for (float v : lanes) best = std::max(best, v);
  return best;
}

// s[j] <- exp(s[j] - max s) for j < L; -> their sum (lane l: keys j = l mod W, in order).
inline float softmax_numerators(float* s, int64_t L) {
  const V::F topv = V::set1(max_of(s, L));
  V::F sum = V::zero();
  for (int64_t j = 0; j < L; j += W) {
    const V::F p = V::keep_first(V::exp(V::sub(V::load_first(s + j, L - j, V::zero()), topv)),
                                 L - j);
    V::store_first(s + j, p, L - j);
    sum = V::add(sum, p);
  }
  return V::sum(sum);
}

// The weighted sums of values: sum_j p[r][j] values[j][d] from zero, by FMAs in order j, per
// row r (a query's head) and dimension d; one rounding to bf16 after the division by the
// row's total (the same bits at both widths). A value row is read as bf16 pairs: its even
// dimensions (a shift) and its odd ones (a mask) go to two accumulators, 2W dimensions a
// chunk, so the sums are kept as [chunk][even W, odd W] and interleaved back at the end.

// sums[r] (in/out, [CH][2W] floats) += p[r][j] * values[j] for j < L, NR rows at once (each
// value row widened once for all of them). NR is a compile-time count and the sums leave
// through plain stores: GCC 12 then keeps the NR x 2 CH accumulators in registers (with more
// work after the loop in the same function it had stored all of them to the stack on every
// key).
template <int CH, int NR>
__attribute__((always_inline)) inline void value_sums(
    const float* const* p, const bf16* const* values, int64_t L, int64_t dh,
    float* const* sums) {
  V::F acc[NR][2 * CH];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 2 * CH; ++c) acc[r][c] = V::load(sums[r] + W * c);
  int64_t n[CH];  // pairs in chunk c
  for (int c = 0; c < CH; ++c) n[c] = std::min<int64_t>(W, (dh - 2 * W * c) / 2);
  for (int64_t j = 0; j < L; ++j) {
    V::F v[2 * CH];
    for (int c = 0; c < CH; ++c)
      V::pairs_first(reinterpret_cast<const uint32_t*>(values[j]) + W * c, n[c], &v[2 * c],
                     &v[2 * c + 1]);
    for (int r = 0; r < NR; ++r) {
      const V::F pj = V::set1(p[r][j]);
      for (int c = 0; c < 2 * CH; ++c) acc[r][c] = V::fma(pj, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 2 * CH; ++c) V::store(sums[r] + W * c, acc[r][c]);
}

// rows value_sums takes at once: up to 24 accumulators (AVX-512), 12 (AVX2)
template <int CH>
constexpr int kValueRows = W == 16 ? (CH == 1 ? 12 : CH == 2 ? 6 : CH == 4 ? 2 : 1)
                                   : (CH == 1 ? 6 : CH == 2 ? 3 : 1);

// value_sums for count (1 <= count <= NR) rows
template <int CH, int NR = kValueRows<CH>>
void value_sums_of(const float* const* p, int count, const bf16* const* values, int64_t L,
                   int64_t dh, float* const* sums) {
  if constexpr (NR > 1) {
    if (count < NR) return value_sums_of<CH, NR - 1>(p, count, values, L, dh, sums);
  }
  value_sums<CH, NR>(p, values, L, dh, sums);
}

// out[d] = bf16(sums / total), the sums as value_sums keeps them
template <int CH>
void store_values(const float* sums, float total, int64_t dh, bf16* out) {
  alignas(64) float buf[2 * W * CH];
  const V::F t = V::set1(total);
  for (int c = 0; c < 2 * CH; ++c) V::store(buf + W * c, V::div(V::load(sums + W * c), t));
  for (int64_t d = 0; d < dh; ++d)
    out[d] = bf16(buf[2 * W * (d / (2 * W)) + W * (d % 2) + (d % (2 * W)) / 2]);
}

#ifdef EAGLE2_AMX
// ---- The weighted sums of values on the AMX tiles ----
// docs/cpu-backend.md "Exact bf16 attention". Where the tiles exist, a query row's sums are
// sum_j bf16(p_j) v_j over its logical keys j (committed keys in position order, then its
// tree entries in order: the sequence plain decoding has them in), in chunks of 32 aligned
// to the logical index (keys [32c, 32c + 32) a chunk), each chunk one TDPBF16PS per 16
// dimensions into the row's fp32 sums, chunks in order from zero. A chunk's result is a
// function of the row's sums before it, its 32 probabilities (zeros past the row's last
// key) and the chunk's 32 value rows alone, whatever other rows share the tile multiply, so
// a tree node gets the bits of the same token decoded alone after its path was committed:
// a chunk the node reads through the tree (the committed keys from the last full chunk on,
// then its ancestors) holds the values that chunk holds in plain decoding, where they are
// committed. Lanes past a row's last key may hold other nodes' values (rows whose entries
// are a prefix of another's share its tiles); their probability is zero, so they add zeros
// (an exactly-zero sum could come out as -0 instead of +0, nothing else).

// n uint32 of v at a 64-byte boundary (v grown to hold them)
inline uint32_t* aligned64(std::vector<uint32_t>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n + 16) v.resize(static_cast<size_t>(n + 16));
  const auto at = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - at % 64) % 64) / 4;
}

// 32 value rows (rows[i]; nullptr: zeros) of dh (a multiple of 32) -> dh / 16 VNNI B tiles
// at dst, 256 uint32 each: tile t's row i holds dimensions 16t .. 16t + 15 of rows 2i and
// 2i + 1 as bf16 pairs (first row's value in the low half)
void pack_value_chunk(const bf16* const* rows, int64_t dh, uint32_t* dst) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                               6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                               12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int i = 0; i < 16; ++i) {
    const bf16* a = rows[2 * i];
    const bf16* b = rows[2 * i + 1];
    for (int64_t d = 0; d < dh; d += 32) {
      const __m512i va = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + (d / 16 * 16 + i) * 16, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(dst + (d / 16 * 16 + 16 + i) * 16,
                          _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// rows (<= 16, the tiles configured for them) of sums at c (fp32, ldc floats apart), dims
// [16 t0, 16 (t0 + nt)), nt <= 4: += (from zero where !load) the chunks' products, chunk k's
// probabilities at a + 32 k (lda bf16 apart) and its tiles at vb + k chunk_words
inline void value_tiles(const bf16* a, int64_t lda, const uint32_t* vb, int64_t chunk_words,
                        int64_t chunks, int t0, int nt, float* c, int64_t ldc, bool load) {
  float* c0 = c + 16 * t0;
  if (load) {
    _tile_loadd(4, c0, ldc * 4);
    if (nt > 1) _tile_loadd(5, c0 + 16, ldc * 4);
    if (nt > 2) _tile_loadd(6, c0 + 32, ldc * 4);
    if (nt > 3) _tile_loadd(7, c0 + 48, ldc * 4);
  } else {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t k = 0; k < chunks; ++k) {
    const uint32_t* b = vb + k * chunk_words + 256 * t0;
    _tile_loadd(0, a + 32 * k, lda * 2);
    _tile_loadd(1, b, 64);
    _tile_dpbf16ps(4, 0, 1);
    if (nt > 1) {
      _tile_loadd(2, b + 256, 64);
      _tile_dpbf16ps(5, 0, 2);
    }
    if (nt > 2) {
      _tile_loadd(3, b + 512, 64);
      _tile_dpbf16ps(6, 0, 3);
    }
    if (nt > 3) {
      _tile_loadd(1, b + 768, 64);
      _tile_dpbf16ps(7, 0, 1);
    }
  }
  _tile_stored(4, c0, ldc * 4);
  if (nt > 1) _tile_stored(5, c0 + 16, ldc * 4);
  if (nt > 2) _tile_stored(6, c0 + 32, ldc * 4);
  if (nt > 3) _tile_stored(7, c0 + 48, ldc * 4);
}

// all dh dims of value_tiles, 64 at a time
inline void value_tiles_all(const bf16* a, int64_t lda, const uint32_t* vb,
                            int64_t chunk_words, int64_t chunks, int64_t dh, float* c,
                            int64_t ldc, bool load) {
  for (int64_t t0 = 0; t0 < dh / 16; t0 += 4)
    value_tiles(a, lda, vb, chunk_words, chunks, static_cast<int>(t0),
                static_cast<int>(std::min<int64_t>(4, dh / 16 - t0)), c, ldc, load);
}

// The weighted sums and outputs of query rows r < nq (position n0 + r / G, head r % G) whose
// numerators are in s (rows R apart: the committed keys', then the row's tree entries'),
// `counts` entries each (tree entries' value rows in `tree`, T apart a position), totals in
// `total`; committed value rows in values (len of them).
void attend_values_amx(const Unit& u, int64_t n0, int64_t n1, const float* s, int64_t R,
                       const float* total, const bf16* const* values, const bf16* const* tree,
                       const int64_t* counts, Scratch& w) {
  const int G = u.G;
  const int64_t dh = u.dh, L = u.len, nq = (n1 - n0) * G, np = n1 - n0;
  const int64_t chunk_words = dh * 16;  // uint32 of a chunk's dh / 16 tiles
  const int64_t full = L / 32;  // committed chunks every row shares
  int64_t most = 0;
  for (int64_t i = 0; i < np; ++i) most = std::max(most, counts[i]);
  const int64_t Rb = (L + most + 31) / 32 * 32;  // a row's bf16 numerators, zero padded
  w.pb.resize(static_cast<size_t>(nq * Rb));
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t n = L + counts[r / G];
    const float* src = s + r * R;
    bf16* dst = w.pb.data() + r * Rb;
    for (int64_t j = 0; j < Rb; j += 16) {
      const __m512 p = _mm512_maskz_loadu_ps(j < n ? V::first(n - j) : 0, src + j);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(p));
    }
  }
  w.acc.resize(static_cast<size_t>(nq * dh));
  // the committed full chunks, shared by every row: 16 rows a pass
  // (those the cache keeps, the rest packed here)
  const int64_t kept = u.vblocks != nullptr ? std::min(u.vkept, full) : 0;
  uint32_t* vc = aligned64(w.vc, std::max<int64_t>(full - kept, 1) * chunk_words);
  for (int64_t c = kept; c < full; ++c)
    pack_value_chunk(values + 32 * c, dh, vc + (c - kept) * chunk_words);
  int configured = 0;
  for (int64_t r0 = 0; r0 < nq; r0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, nq - r0));
    if (rows != configured) configure_tiles(configured = rows);
    const bf16* a = w.pb.data() + r0 * Rb;
    float* c = w.acc.data() + r0 * dh;
    if (kept > 0) value_tiles_all(a, Rb, u.vblocks, chunk_words, kept, dh, c, dh, false);
    if (full > kept)
      value_tiles_all(a + 32 * kept, Rb, vc, chunk_words, full - kept, dh, c, dh, kept > 0);
    if (full == 0) std::fill(c, c + rows * dh, 0.0f);
  }
  // the rest per group of positions: a group's entries are a prefix of its lead's (the one
  // with the most: a chain, or a prefill, is one group), whose chunks from `full` on are
  // packed once (committed keys past the last full chunk, then the lead's entries, zeros)
  w.order.resize(static_cast<size_t>(np));
  for (int64_t i = 0; i < np; ++i) w.order[i] = i;
  std::stable_sort(w.order.begin(), w.order.end(),
                   [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  w.lead.assign(static_cast<size_t>(np), -1);
  const bf16* rows32[32];
  alignas(64) bf16 sa[16 * 32];
  alignas(64) float sc[16 * 128];
  for (int64_t li = 0; li < np; ++li) {
    const int64_t lead = w.order[li];
    if (w.lead[lead] >= 0) continue;
    // its members: itself and the positions after it whose entries are a prefix of its own
    for (int64_t mi = li; mi < np; ++mi) {
      const int64_t m = w.order[mi];
      const bf16* const* own = tree + m * u.T;
      if (w.lead[m] < 0 && std::equal(own, own + counts[m], tree + lead * u.T)) w.lead[m] = lead;
    }
    const int64_t end = L + counts[lead], chunks = (end + 31) / 32 - full;
    uint32_t* vt = aligned64(w.vt, std::max<int64_t>(chunks, 1) * chunk_words);
    for (int64_t c = 0; c < chunks; ++c) {
      for (int i = 0; i < 32; ++i) {
        const int64_t j = 32 * (full + c) + i;
        rows32[i] = j < L ? values[j] : j < end ? tree[lead * u.T + (j - L)] : nullptr;
      }
      pack_value_chunk(rows32, dh, vt + c * chunk_words);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = 32 * (full + c);  // rows whose keys reach into this chunk
      int64_t picked[16];
      int count = 0;
      const auto flush = [&]() {
        if (count == 0) return;
        if (count != configured) configure_tiles(configured = count);
        for (int k = 0; k < count; ++k) {
          std::memcpy(sa + 32 * k, w.pb.data() + picked[k] * Rb + first, 64);
          std::memcpy(sc + 128 * k, w.acc.data() + picked[k] * dh, dh * sizeof(float));
        }
        value_tiles_all(sa, 32, vt + c * chunk_words, chunk_words, 1, dh, sc, 128,
                        true);
        for (int k = 0; k < count; ++k)
          std::memcpy(w.acc.data() + picked[k] * dh, sc + 128 * k, dh * sizeof(float));
        count = 0;
      };
      for (int64_t mi = li; mi < np; ++mi) {
        const int64_t m = w.order[mi];
        if (w.lead[m] != lead || L + counts[m] <= first) continue;
        for (int g = 0; g < G; ++g) {
          picked[count++] = m * G + g;
          if (count == 16) flush();
        }
      }
      flush();
    }
  }
  if (configured) _tile_release();
  for (int64_t r = 0; r < nq; ++r) {
    const __m512 t = _mm512_set1_ps(total[r]);
    bf16* out = u.out + (n0 + r / G) * u.out_stride + (r % G) * dh;
    for (int64_t d = 0; d < dh; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_div_ps(
                              _mm512_loadu_ps(w.acc.data() + r * dh + d), t)));
  }
}
#endif

// query positions of a unit scored together: bounds the score buffers (a prefill of P tokens
// is a unit of P positions over P tree entries; unchunked, its scores took 2 x 3P^2 floats)
constexpr int64_t kQueryChunk = 64;

// Query positions n0 <= n < n1 (at most kQueryChunk) of a unit whose keys `attend_unit_ch`
// transposed (nbc committed blocks: the unit's u.kept kept ones, then the rest in w.kc; the
// tree entries' in w.kt) and whose committed values' addresses are in w.values: scores,
// softmax, weighted sums.
template <int CH>
void attend_chunk(const Unit& u, int64_t n0, int64_t n1, int64_t nbc, Scratch& w) {
  const int64_t pairs = u.dh / 2;
  const int G = u.G;
  int64_t last = -1;  // the last tree entry any of these positions attends to
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = u.T - 1; m > last; --m)
      if (u.mask[n * u.T + m]) {
        last = m;
        break;
      }
  const int64_t nbt = (last + W) / W;  // tree blocks scored
  const int64_t nq = (n1 - n0) * G;  // query (n, g) is row (n - n0) G + g
  const bool amx = attention_on_tiles(u.dh);
  if (amx) {
    w.qb.resize(static_cast<size_t>(nq * u.dh));
    for (int64_t r = 0; r < nq; ++r)
      std::memcpy(w.qb.data() + r * u.dh, u.q + ((r % G) * u.N + n0 + r / G) * u.dh,
                  static_cast<size_t>(u.dh) * sizeof(bf16));
  } else {
    w.qe.resize(static_cast<size_t>(nq * pairs));
    w.qo.resize(static_cast<size_t>(nq * pairs));
    for (int64_t r = 0; r < nq; ++r) {
      const bf16* src = u.q + ((r % G) * u.N + n0 + r / G) * u.dh;
      for (int64_t i = 0; i < pairs; ++i) {
        w.qe[r * pairs + i] = static_cast<float>(src[2 * i]);
        w.qo[r * pairs + i] = static_cast<float>(src[2 * i + 1]);
      }
    }
  }
  // every query row's scores against nblk key blocks (block b at blk[b]) -> score rows
  // `stride` apart
  const auto score = [&](const uint32_t* const* blk, int64_t nblk, float* s, int64_t stride) {
#ifdef EAGLE2_AMX
    if (amx) return score_queries_amx(w.qb.data(), nq, u.dh, blk, nblk, u.scale, s, stride);
#endif
    score_queries(w.qe.data(), w.qo.data(), nq, pairs, blk, nblk, u.scale, s, stride);
  };
  // a score row: the committed keys' (W a block), then the tree entries' the mask keeps
  const int64_t R = nbc * W + u.T, RT = std::max<int64_t>(nbt, 1) * W;
  w.s.resize(static_cast<size_t>(nq * R));
  w.ts.resize(static_cast<size_t>(nq * RT));
  score(w.kp.data(), nbc, w.s.data(), R);
  score(w.kp.data() + nbc, nbt, w.ts.data(), RT);
  // per query position: its heads' scores, the tree entries its mask keeps appended; softmax
  w.total.resize(static_cast<size_t>(nq));
  w.tree.resize(static_cast<size_t>((n1 - n0) * std::max<int64_t>(u.T, 1)));
  w.counts.resize(static_cast<size_t>(n1 - n0));
  for (int64_t n = n0; n < n1; ++n) {
    const bool* row = u.mask + n * u.T;
    const bf16** tree = w.tree.data() + (n - n0) * u.T;
    int64_t count = 0;
    for (int64_t m = 0; m < u.T; ++m)
      if (row[m]) tree[count++] = u.value(u.len + m);
    w.counts[n - n0] = count;
    for (int g = 0; g < G; ++g) {
      const int64_t r = (n - n0) * G + g;
      float* s = w.s.data() + r * R;
      const float* t = w.ts.data() + r * RT;
      for (int64_t m = 0, k = u.len; m < u.T; ++m)
        if (row[m]) s[k++] = t[m];
      w.total[r] = softmax_numerators(s, u.len + count);
    }
  }
#ifdef EAGLE2_AMX
  if (amx)
    return attend_values_amx(u, n0, n1, w.s.data(), R, w.total.data(), w.values.data(),
                             w.tree.data(), w.counts.data(), w);
#endif
  // the weighted sums: the committed values (shared) for several rows at once, then each
  // row's own tree entries, continuing the same sums in order
  w.sums.assign(static_cast<size_t>(nq * 2 * W * CH), 0.0f);
  constexpr int NR = kValueRows<CH>;
  const float* p[NR];
  float* sums[NR];
  for (int64_t r0 = 0; r0 < nq; r0 += NR) {
    const int count = static_cast<int>(std::min<int64_t>(NR, nq - r0));
    for (int i = 0; i < count; ++i) {
      p[i] = w.s.data() + (r0 + i) * R;
      sums[i] = w.sums.data() + (r0 + i) * 2 * W * CH;
    }
    value_sums_of<CH>(p, count, w.values.data(), u.len, u.dh, sums);
  }
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t n = n0 + r / G;
    const float* pr = w.s.data() + r * R + u.len;
    float* sr = w.sums.data() + r * 2 * W * CH;
    value_sums<CH, 1>(&pr, w.tree.data() + (n - n0) * u.T, w.counts[n - n0], u.dh, &sr);
    store_values<CH>(sr, w.total[r], u.dh, u.out + n * u.out_stride + (r % G) * u.dh);
  }
}

// Blocks b0 <= b < b1 of n keys (key j at key(j)) -> consecutive blocks from dst (lanes
// past key n - 1 zeros)
template <typename Key>
void transpose_blocks(const Key& key, int64_t n, int64_t b0, int64_t b1, int64_t pairs,
                      uint32_t* dst) {
  const bf16* rows[W];
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int count = static_cast<int>(std::min<int64_t>(W, n - W * blk));
    for (int l = 0; l < count; ++l) rows[l] = key(W * blk + l);
    V::transpose(rows, count, pairs, dst + (blk - b0) * pairs * W);
  }
}

// Queries n0 <= n < n1 of one unit (`Unit`), each with its G heads: every committed key and
// tree entry transposed once (committed blocks kept from earlier calls are read where they
// are), then in chunks of positions (`attend_chunk`) the scores of all their queries (each
// query's own keys picked out), per position the softmax and the weighted sum of its values
// (committed, then the tree entries its mask keeps, in order). Each query's result is a
// function of it and its keys only.
template <int CH>
void attend_unit_ch(const Unit& u, int64_t n0, int64_t n1, Scratch& w) {
  const int64_t pairs = u.dh / 2, nbc = (u.len + W - 1) / W, nbt = (u.T + W - 1) / W;
  const int64_t words = pairs * W;  // uint32 a block
  w.kc.resize(static_cast<size_t>(std::max<int64_t>(nbc - u.kept, 1) * words));
  w.kt.resize(static_cast<size_t>(std::max<int64_t>(nbt, 1) * words));
  transpose_blocks([&](int64_t j) { return u.key(j); }, u.len, u.kept, nbc, pairs,
                   w.kc.data());
  transpose_blocks([&](int64_t j) { return u.key(u.len + j); }, u.T, 0, nbt, pairs,
                   w.kt.data());
  // the blocks scored: the committed keys' (kept ones, then the rest), the tree entries'
  w.kp.resize(static_cast<size_t>(nbc + nbt));
  for (int64_t b = 0; b < nbc; ++b)
    w.kp[b] = b < u.kept ? u.kept_block(b, words) : w.kc.data() + (b - u.kept) * words;
  for (int64_t b = 0; b < nbt; ++b) w.kp[nbc + b] = w.kt.data() + b * words;
  w.values.resize(static_cast<size_t>(u.len));
  if (u.table == nullptr) {
    for (int64_t j = 0; j < u.len; ++j) w.values[j] = u.v + j * u.vs;
  } else {  // page by page (a division a key had cost ~2 ms a step at 2,000 keys)
    for (int64_t j0 = 0; j0 < u.len; j0 += u.page) {
      const bf16* first = u.v + u.table[j0 / u.page] * u.vb;
      for (int64_t o = 0, n = std::min(u.page, u.len - j0); o < n; ++o)
        w.values[j0 + o] = first + o * u.vs;
    }
  }
  for (int64_t c0 = n0; c0 < n1; c0 += kQueryChunk)
    attend_chunk<CH>(u, c0, std::min(n1, c0 + kQueryChunk), nbc, w);
}

// The full blocks of W committed keys of one (slot, KV head) in its kept key blocks
// (`attention`'s key_blocks: [dh / 2][W] uint32 a block, from blocks): those before *valid
// were transposed by an earlier call and are still right, since a call at base b writes keys
// at b and after only (and `KVCache.copy_slot`, the one other writer, resets the count). The
// blocks from *valid to base / W are transposed and the count set to base / W (also when it
// was larger: a rewound request rewrites the keys after its base).
void update_key_blocks(const bf16* k, int64_t ks, int64_t base, int64_t dh, uint32_t* blocks,
                       int32_t* valid) {
  const int64_t pairs = dh / 2, full = base / W;
  transpose_blocks([&](int64_t j) { return k + j * ks; }, base, *valid, full, pairs,
                   blocks + *valid * pairs * W);
  *valid = static_cast<int32_t>(full);
}

#ifdef EAGLE2_AMX
// The committed values of one (slot, KV head) as AMX tiles in chunks of 32 (`pack_value_chunk`,
// dh x 16 uint32 each, at chunks): the first `from` were packed by an earlier call and are
// still right, for the reason `update_key_blocks`' blocks are (the caller passes the key
// blocks' valid keys before their update, / 32: a rewind or `copy_slot` cuts both); the full
// chunks from there to base / 32 are packed.
void update_value_chunks(const bf16* v, int64_t vs, int64_t base, int64_t dh, int64_t from,
                         uint32_t* chunks) {
  const bf16* rows[32];
  for (int64_t c = from; c < base / 32; ++c) {
    for (int i = 0; i < 32; ++i) rows[i] = v + (32 * c + i) * vs;
    pack_value_chunk(rows, dh, chunks + c * dh * 16);
  }
}
#endif

// A paged cache's kept key blocks (`attention`'s key_blocks over its blocks, [blocks, KVH,
// page / W blocks of dh / 2 x W uint32], and key_blocks_valid [blocks, KVH]): the first
// valid[p, h] key blocks of block p hold its first entries transposed. Every call brings each
// page i of a request at base b (and those its T new entries reach) to
// clamp(b - i page, 0, page) / W valid blocks (`update_key_blocks` within the block): its
// entries before the base are committed, and nobody writes them while the block is the
// request's (a block shared through the prefix cache is full and never written); the pages
// the new entries reach drop their later blocks. So a block taken from the pool with another
// request's count is cut to what its new request has committed when that request's entries
// first land in it, before any key block is read. A block shared by several requests of the
// call (a cached prefix) is updated once (their counts agree: it lies before every one's base).
void update_page_blocks(const Pages& pages, const int64_t* slp, const int64_t* bp, int64_t B,
                        int64_t T, const bf16* kp, const c10::IntArrayRef ks, int64_t KVH,
                        int64_t dh, uint32_t* kbp, int32_t* kvp, int64_t unit_stride) {
  std::vector<int64_t> work;  // (block, valid key blocks it gets) pairs
  std::vector<uint8_t> seen(static_cast<size_t>(pages.blocks), 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i * pages.page < bp[b] + T; ++i) {
      const int64_t p = pages.block(slp[b], i * pages.page);
      if (seen[p]) continue;
      seen[p] = 1;
      const int64_t full =
          std::clamp<int64_t>(bp[b] - i * pages.page, 0, pages.page) / W;
      for (int64_t h = 0; h < KVH; ++h)
        if (kvp[p * KVH + h] != full) {
          work.push_back(p);
          work.push_back(full);
          break;
        }
    }
  }
  const int64_t items = static_cast<int64_t>(work.size()) / 2;
  at::parallel_for(0, items * KVH, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = work[2 * (t / KVH)], full = work[2 * (t / KVH) + 1], h = t % KVH;
      update_key_blocks(kp + p * ks[0] + h * ks[1], ks[2], full * W, dh,
                        kbp + (p * KVH + h) * unit_stride, kvp + p * KVH + h);
    }
  });
}

void attend_unit(const Unit& u, int64_t n0, int64_t n1, Scratch& w) {
  if (u.dh <= 2 * W) {
    attend_unit_ch<1>(u, n0, n1, w);
  } else if (u.dh <= 4 * W) {
    attend_unit_ch<2>(u, n0, n1, w);
  } else if (u.dh <= 8 * W) {
    attend_unit_ch<4>(u, n0, n1, w);
  } else {
    attend_unit_ch<8>(u, n0, n1, w);
  }
}


}  // namespace

// Exact attention (docs/cpu-backend.md, "Exact bf16 attention"): query n of request b at cache
// position base[b] + (its depth) attends to the committed keys [0, base[b]) and then to the
// tree entries m with tree_mask[b, n, m] (its ancestors and itself, at cache positions
// base[b] + m), in that order: the order plain decoding has them in. q [B, Hq, N, Dh];
// one layer's cache_k [slots, KVH, S, Dh], cache_v [slots, KVH, S, >= Dh] (this step's
// entries written); -> [B, N, Hq Dh], what o_proj reads.
//
// key_blocks, key_blocks_valid (optional, both or neither): the layer's committed keys kept
// transposed from call to call, [slots, KVH, ceil(S / 16), Dh / 2 * 16] int32 (per slot and
// KV head, the bf16 pairs of blocks of W keys, W = 16 with AVX-512, 8 with AVX2, as
// `Lanes::transpose` lays them out) and [slots, KVH] int32, the blocks of each still valid
// (zeros: none). Each call brings the
// blocks before base up to date (`update_key_blocks`) and scores the committed keys from
// them: the same scores as without (a score does not depend on where its key block lies),
// without transposing every committed key again at every call.
//
// block_tables: a paged cache (`Pages`): cache_k [blocks, KVH, page, Dh], and the key blocks
// kept per block, [blocks, KVH, page / 16, Dh / 2 * 16] and [blocks, KVH]
// (`update_page_blocks`; used where page is a multiple of W; the values are not kept as
// tiles).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& cache_k,
                        const torch::Tensor& cache_v, const torch::Tensor& slots,
                        const torch::Tensor& base, const torch::Tensor& tree_mask,
                        double scale, const std::optional<torch::Tensor>& key_blocks,
                        const std::optional<torch::Tensor>& key_blocks_valid,
                        const std::optional<torch::Tensor>& block_tables) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.is_contiguous() && q.dim() == 4,
              "q must be a contiguous bf16 [B, Hq, N, Dh]");
  const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), dh = q.size(3);
  const int64_t KVH = cache_k.size(1), G = Hq / KVH;
  TORCH_CHECK(Hq % KVH == 0 && G <= kMaxG && dh <= 128 && dh % 8 == 0,
              "head layout not supported (up to 8 query heads per KV head, head size a "
              "multiple of 8 up to 128)");
  TORCH_CHECK(cache_k.scalar_type() == at::kBFloat16 && cache_v.scalar_type() == at::kBFloat16 &&
                  cache_k.stride(3) == 1 && cache_v.stride(3) == 1 && cache_k.size(3) == dh &&
                  cache_v.size(3) >= dh, "cache layer views");
  auto sl = slots.to(at::kLong).contiguous();
  auto bs = base.to(at::kLong).contiguous();
  auto tm = tree_mask.to(at::kBool).contiguous();
  TORCH_CHECK(tm.dim() == 3 && tm.size(0) == B && tm.size(1) == N, "tree_mask [B, N, T]");
  const int64_t T = tm.size(2);
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* bp = bs.data_ptr<int64_t>();
  const bool* mp = tm.data_ptr<bool>();
  const Pages pages(block_tables, cache_k);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(bp[b] >= 0, "cache length out of range");
    pages.check(slp[b], bp[b] + T);
  }
  auto out = torch::empty({B, N, Hq * dh}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = cache_k.data_ptr<bf16>();
  const bf16* vp = cache_v.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const auto ks = cache_k.strides();
  const auto vs = cache_v.strides();
  TORCH_CHECK(key_blocks.has_value() == key_blocks_valid.has_value(),
              "key_blocks and key_blocks_valid go together");
  uint32_t* kbp = nullptr;
  int32_t* kvp = nullptr;
  int64_t unit_stride = 0;  // uint32s of key blocks per (slot, KV head)
  int64_t value_offset = 0;  // where a unit's value tiles start in them (0: not kept)
  // kept key blocks need pages of whole blocks of W keys (else every call transposes them)
  if (key_blocks.has_value() && (!pages.paged() || pages.page % W == 0)) {
    const auto& kb = *key_blocks;
    const auto& kv = *key_blocks_valid;
    const int64_t blocks = (cache_k.size(2) + W - 1) / W;
    TORCH_CHECK(kb.scalar_type() == at::kInt && kb.is_contiguous() && kb.dim() == 4 &&
                    kb.size(0) == cache_k.size(0) && kb.size(1) == KVH &&
                    kb.size(2) * kb.size(3) >= blocks * W * (dh / 2),
                "key_blocks must be a contiguous int32 [slots, KVH, ...] of at least S Dh / 2 "
                "per (slot, KV head), S rounded up to a block");
    TORCH_CHECK(kv.scalar_type() == at::kInt && kv.is_contiguous() &&
                    kv.sizes() == at::IntArrayRef({cache_k.size(0), KVH}),
                "key_blocks_valid must be a contiguous int32 [slots, KVH]");
    kbp = reinterpret_cast<uint32_t*>(kb.data_ptr<int32_t>());
    kvp = kv.data_ptr<int32_t>();
    unit_stride = kb.size(2) * kb.size(3);
#ifdef EAGLE2_AMX
    // room for the values too (`empty_key_blocks`): they are kept after the keys, as tiles
    value_offset = (cache_k.size(2) + 31) / 32 * 32 * (dh / 2);
    if (!(attention_on_tiles(dh) && unit_stride >= 2 * value_offset) || pages.paged())
      value_offset = 0;
#endif
    if (pages.paged()) {
      update_page_blocks(pages, slp, bp, B, T, kp, ks, KVH, dh, kbp, kvp, unit_stride);
    } else {
      at::parallel_for(0, B * KVH, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t b = t / KVH, h = t % KVH, unit = slp[b] * KVH + h;
          const int64_t was = kvp[unit];
          update_key_blocks(kp + slp[b] * ks[0] + h * ks[1], ks[2], bp[b], dh,
                            kbp + unit * unit_stride, kvp + unit);
#ifdef EAGLE2_AMX
          if (value_offset > 0)
            update_value_chunks(vp + slp[b] * vs[0] + h * vs[1], vs[2], bp[b], dh,
                                was * W / 32, kbp + unit * unit_stride + value_offset);
#endif
        }
      });
    }
  }
  // one unit per (request, KV head); with several threads and few units, the queries of a
  // unit split in parts (each transposes the unit's keys again)
  const int64_t units = B * KVH, threads = at::get_num_threads();
  const int64_t parts = threads > 1 && units < 2 * threads
                            ? std::min<int64_t>(N, (2 * threads + units - 1) / units) : 1;
  at::parallel_for(0, units * parts, 1, [&](int64_t t0, int64_t t1) {
    // kept from call to call: growing a vector fills it with zeros (~1 MB a layer after 2,048
    // tokens, which cost more than the scores)
    thread_local Scratch w;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (KVH * parts), h = (t / parts) % KVH, part = t % parts;
      const int64_t at = pages.paged() ? 0 : slp[b];  // the slot's row (paged: block 0)
      Unit u{qp + (b * Hq + h * G) * N * dh, N,
             kp + at * ks[0] + h * ks[1], vp + at * vs[0] + h * vs[1],
             ks[2], vs[2], bp[b], T, mp + b * N * T,
             op + b * N * Hq * dh + h * G * dh, Hq * dh, static_cast<int>(G), dh,
             static_cast<float>(scale)};
      if (pages.paged()) {
        u.table = pages.tables + slp[b] * pages.width;
        u.page = pages.page;
        u.kb = ks[0];
        u.vb = vs[0];
        u.page_blocks = pages.page / W;
        u.block_words = KVH * unit_stride;
      }
      if (kbp != nullptr) {
        u.blocks = kbp + (at * KVH + h) * unit_stride;
        u.kept = bp[b] / W;
        if (value_offset > 0) {
          u.vblocks = u.blocks + value_offset;
          u.vkept = bp[b] / 32;
        }
      }
      attend_unit(u, N * part / parts, N * (part + 1) / parts, w);
    }
  });
  return out;
}


// ---- bf16 linears for a few rows: y [M, N] = x [M, K] @ w [N, K].T ----
// docs/cpu-backend.md, "CPU performance": a decode step multiplies a handful of rows by every
// weight, so its floor is streaming the weights once. The weight is packed once into blocks
// of 32 outputs, [ceil(N / 32)][K / 2][32] uint32, each uint32 the bf16 pair (w[n][2j],
// w[n][2j+1]): one block is read front to back, 128 contiguous bytes per input pair, the
// layout `vdpbf16ps` multiplies. A work unit is four blocks: one to three rows read all four
// at once (four streams), four rows two at a time, up to eight rows one block at a time (16
// accumulators), more rows again in groups of eight from L2. Each output element is summed in
// this order: the pairs of every 512 inputs accumulated one after another into one fp32 lane
// by `vdpbf16ps`, starting from zero, the 512-input partial sums then added in order, one
// rounding to bf16 at the end.
// That is the order oneDNN's packed bf16 kernel (avx512_core_bf16, K <= 1024) uses, so both
// give bitwise the same outputs, and the engine picks either per row count by speed;
// `eagle2.kernels.native_linear_exact` checks the equality on the machine at hand before the
// native kernel is used at all. Any row count gives each row the same result (exactness).
constexpr int64_t kBlockN = 32;
constexpr int kGroups = kBlockN / 16;  // 16-lane accumulators per row and block
constexpr int64_t kPairsPerSum = 256;  // 512 inputs

// Threads take the work in pieces from a shared counter, about kPieces a thread, instead of an
// equal share each: where other processes run on the same cores (the service's router, proxy
// and draft worker beside its engine), one thread is preempted for a while and the others
// would wait for its share at the end of the region; here they take the pieces it has not
// started, so a region waits only for the piece in hand. The service's tokens/s on 2 cores
// rose 8-11% at 1 stream and 15% at 8, in process unchanged (docs/cpu-backend.md, "CPU
// performance"). Results do not depend on which thread computes a piece.
constexpr int64_t kPieces = 4;

// f(i0, i1) over [0, n) in pieces of `piece` (whole pieces but the last); fewer than two
// pieces: an equal share a thread (one call, inline, with one thread or in a parallel region)
template <typename F>
inline void parallel_pieces(int64_t n, int64_t piece, const F& f) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || n < 2 * piece || at::in_parallel_region()) {
    at::parallel_for(0, n, 1, f);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i0; (i0 = next.fetch_add(piece, std::memory_order_relaxed)) < n;)
      f(i0, std::min(n, i0 + piece));
  });
}

// f(b0, b1) over [0, blocks), kPieces pieces a thread of a multiple of 4 blocks each (the
// linears go four blocks at a time). Any row count is split: the weights are read once whatever
// the split, so two cores read them in half the time where each core has its own memory
// bandwidth (this Xeon VM: 15 GB/s one thread, 29 two: one row through every linear and the
// lm_head 15.6 -> 8.9 ms on two threads, `benchmarks/native_linears.py`), and `eagle2.threads`
// measures whether more threads decode faster on the machine at hand. A parallel region's
// threads wake from a spin (`GOMP_SPINCOUNT`, set by `eagle2/__init__.py`), not from sleep:
// ~120 regions a forward each waking a sleeping thread had cost more than the split saved.
template <typename F>
inline void parallel_blocks(int64_t blocks, const F& f) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  parallel_pieces(blocks, std::max<int64_t>(4, (blocks / (threads * kPieces) + 3) / 4 * 4), f);
}

#ifdef EAGLE2_AVX512
// A block is read front to back, 128 bytes per input pair; with a few rows the loop computes
// long enough per line that the hardware prefetcher falls behind and the time becomes memory
// plus compute. Asking for the line 4 KB ahead in each stream overlaps the two (measured: 8
// rows 51 -> 35 ms over the target's linears, the vdpbf16ps kernel, 8 KB ahead; 1 row
// unchanged). On the AVX-512 Xeon with two threads the FMA kernel over the target's linears
// and lm_head read 1-2 rows 5-9% faster 4 KB ahead than 8 KB, 4-16 rows the same or up to 3%
// faster, one thread the same (`benchmarks/native_linears.py --threads 2 --against`); 2 KB
// lost 5% at 8 rows.
constexpr int64_t kPrefetch = 1024;  // uint32s ahead
inline void prefetch_block(const uint32_t* wk) {
  _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch + 16), _MM_HINT_T0);
}

// the first `count` of 16 floats, rounded to bf16 (nearest even), to out
inline void store_bf16_16(bf16* out, __m512 v, int64_t count) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  if (count >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  } else {
    alignas(32) bf16 tail[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tail), h);
    std::copy(tail, tail + count, out);
  }
}

inline __m512 round_bf16(__m512 v) {  // fp32 -> the nearest bf16 (even), as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// M rows of x, B consecutive blocks of kBlockN outputs. The input pairs come in column chunks of
// C2 pairs (K2 when not chunked): a chunked weight's result is each chunk's product rounded to
// bf16, added in fp32 in chunk order (what `kernels.BlockedWeight` does with oneDNN's kernel).
template <int M, int B>
inline void linear_tile(const uint32_t* x, int64_t x_stride, const uint32_t* w, int64_t K2,
                        int64_t C2, bf16* y, int64_t y_stride, int64_t n0, int64_t N) {
  __m512 acc[M][B][kGroups], part[M][B][kGroups], total[M][B][kGroups];
  for (int64_t c0 = 0; c0 < K2; c0 += C2) {
    const int64_t c1 = std::min(K2, c0 + C2);
    for (int64_t k0 = c0; k0 < c1; k0 += kPairsPerSum) {
      for (int m = 0; m < M; ++m)
        for (int b = 0; b < B; ++b)
          for (int r = 0; r < kGroups; ++r) acc[m][b][r] = _mm512_setzero_ps();
      const int64_t k1 = std::min(c1, k0 + kPairsPerSum);
      for (int64_t k = k0; k < k1; ++k) {
        __m512bh xb[M];
        for (int m = 0; m < M; ++m)
          xb[m] = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * x_stride + k]));
        for (int b = 0; b < B; ++b) {
          const uint32_t* wk = w + (b * K2 + k) * kBlockN;
          prefetch_block(wk);
          for (int r = 0; r < kGroups; ++r) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wk + 16 * r);
            for (int m = 0; m < M; ++m)
              acc[m][b][r] = _mm512_dpbf16_ps(acc[m][b][r], wv, xb[m]);
          }
        }
      }
      for (int m = 0; m < M; ++m)
        for (int b = 0; b < B; ++b)
          for (int r = 0; r < kGroups; ++r)
            part[m][b][r] = k0 > c0 ? _mm512_add_ps(part[m][b][r], acc[m][b][r]) : acc[m][b][r];
    }
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < B; ++b)
        for (int r = 0; r < kGroups; ++r) {
          if (C2 >= K2) total[m][b][r] = part[m][b][r];
          else if (c0 == 0) total[m][b][r] = round_bf16(part[m][b][r]);
          else total[m][b][r] = _mm512_add_ps(total[m][b][r], round_bf16(part[m][b][r]));
        }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < kGroups; ++r) {
        const int64_t n = n0 + b * kBlockN + r * 16;
        if (n < N) store_bf16_16(y + m * y_stride + n, total[m][b][r], N - n);
      }
}

// rows [0, M) of x against B consecutive blocks at w
template <int B>
inline void linear_rows(const uint32_t* x, const uint32_t* w, int64_t K2, int64_t C2, bf16* y,
                        int64_t N, int64_t n0, int64_t M) {
  const int64_t bs = K2 * kBlockN;
  for (int64_t m = 0; m < M;) {
    const uint32_t* xm = x + m * K2;
    bf16* ym = y + m * N;
    const int64_t left = M - m;
    if (left >= 8) {
      for (int b = 0; b < B; ++b) linear_tile<8, 1>(xm, K2, w + b * bs, K2, C2, ym, N, n0 + b * kBlockN, N);
      m += 8;
    } else if (left >= 6) {
      for (int b = 0; b < B; ++b) linear_tile<6, 1>(xm, K2, w + b * bs, K2, C2, ym, N, n0 + b * kBlockN, N);
      m += 6;
    } else if (left >= 4 && B % 2 == 0) {
      for (int b = 0; b < B; b += 2) linear_tile<4, 2>(xm, K2, w + b * bs, K2, C2, ym, N, n0 + b * kBlockN, N);
      m += 4;
    } else if (left >= 2) {
      linear_tile<2, B>(xm, K2, w, K2, C2, ym, N, n0, N);
      m += 2;
    } else {
      linear_tile<1, B>(xm, K2, w, K2, C2, ym, N, n0, N);
      m += 1;
    }
  }
}

#endif

torch::Tensor pack_linear(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.device().is_cpu() && weight.size(1) % 2 == 0,
              "pack_linear expects a bf16 CPU weight [N, K] with K even");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, blocks = (N + kBlockN - 1) / kBlockN;
  auto packed = torch::zeros({blocks, K2, kBlockN}, torch::dtype(torch::kInt32));
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* pp = reinterpret_cast<uint32_t*>(packed.data_ptr());
  at::parallel_for(0, N, kBlockN, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t j = 0; j < K2; ++j)
        pp[((n / kBlockN) * K2 + j) * kBlockN + n % kBlockN] =
            static_cast<uint32_t>(wp[n * K + 2 * j]) |
            (static_cast<uint32_t>(wp[n * K + 2 * j + 1]) << 16);
  });
  return packed;
}

// x [..., K] bf16, packed from pack_linear -> [..., out_features] bf16; chunk_features: the
// width of the column chunks (0: one chunk)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                     int64_t chunk_features) {
#ifndef EAGLE2_AVX512
  TORCH_CHECK(false, "linear: the bf16 dot-product kernel needs AVX512-BF16; "
              "this build has AVX2 (use linear_fma)");
#else
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "linear expects a bf16 CPU input");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockN && packed.scalar_type() == at::kInt &&
                  x.size(-1) == 2 * packed.size(1) &&
                  (out_features + kBlockN - 1) / kBlockN == packed.size(0),
              "linear: the input's features or out_features do not match the packed weight");
  const auto xc = x.contiguous();
  const int64_t K2 = packed.size(1), N = out_features, blocks = packed.size(0);
  const int64_t M = xc.numel() / (2 * K2);
  TORCH_CHECK(chunk_features % 2 == 0 && chunk_features >= 0,
              "linear: chunk_features must be even");
  const int64_t C2 = chunk_features ? std::min(K2, chunk_features / 2) : K2;
  auto sizes = xc.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, xc.options());
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  auto* yp = y.data_ptr<bf16>();
  // each thread an equal share of the blocks (parallel_blocks), four at a time, then one
  parallel_blocks(blocks, [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    for (; b + 4 <= b1; b += 4)
      linear_rows<4>(xp, wp + b * K2 * kBlockN, K2, C2, yp, N, b * kBlockN, M);
    for (; b < b1; ++b) linear_rows<1>(xp, wp + b * K2 * kBlockN, K2, C2, yp, N, b * kBlockN, M);
  });
  return y;
#endif
}


// ---- the same products by fp32 FMAs: y [M, N] = x [M, K] @ w [N, K].T ----
// Same packed weight. Where vdpbf16ps is slow (an Intel Xeon without AMX here: 1.2 G of them a
// second against 5.3 G fp32 FMAs of 16 lanes, i.e. 2.3x fewer multiply-adds), the bf16 kernel
// above is compute-bound from 3-4 rows on, and a tree of 8 tokens cost 1.9x one token. Here a
// weight pair (w[n][2j], w[n][2j+1]) is widened to two fp32 lanes (a shift, a mask: bf16 is the
// top half of an fp32) and each row adds w[n][2j] * x[2j], then w[n][2j+1] * x[2j+1], by fused
// multiply-adds into one fp32 accumulator per output, j = 0, 1, ... K/2 - 1, from zero; one
// rounding to bf16 at the end. That order is the same for every tile shape, row count and
// thread, so each row's result does not depend on the rows beside it (exactness), but it is
// not oneDNN's order (`vdpbf16ps` sums pairs, 512-input partials, flushes denormals): a
// target uses either this kernel for every row count or the bf16 ones, never a mix
// (`eagle2.kernels.FMA`). The inputs are widened to fp32 once per call.
#ifdef EAGLE2_AVX512
template <int M, int B>
inline void fma_tile(const float* x, int64_t K2, const uint32_t* w, bf16* y, int64_t y_stride,
                     int64_t n0, int64_t N) {
  __m512 acc[M][B][kGroups];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < kGroups; ++r) acc[m][b][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    for (int b = 0; b < B; ++b) {
      const uint32_t* wk = w + (b * K2 + k) * kBlockN;
      prefetch_block(wk);
      for (int r = 0; r < kGroups; ++r) {
        __m512 even, odd;
        split_pairs(_mm512_loadu_si512(wk + 16 * r), &even, &odd);
        for (int m = 0; m < M; ++m) {
          const float* xm = x + m * 2 * K2 + 2 * k;
          acc[m][b][r] = _mm512_fmadd_ps(even, _mm512_set1_ps(xm[0]), acc[m][b][r]);
          acc[m][b][r] = _mm512_fmadd_ps(odd, _mm512_set1_ps(xm[1]), acc[m][b][r]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < kGroups; ++r) {
        const int64_t n = n0 + b * kBlockN + r * 16;
        if (n < N) store_bf16_16(y + m * y_stride + n, acc[m][b][r], N - n);
      }
}

// M rows against `blocks` (4, or 1 at a weight's end) consecutive blocks, one pass over their
// weights: up to 3 rows read four blocks at once (four streams), up to 6 two at a time, more
// one at a time (at most 24 accumulators a tile)
template <int M>
inline void fma_pass(const float* x, int64_t K2, const uint32_t* w, bf16* y, int64_t N,
                     int64_t n0, int64_t blocks) {
  const int64_t bs = K2 * kBlockN;
  if constexpr (M <= 3) {
    if (blocks == 4) return fma_tile<M, 4>(x, K2, w, y, N, n0, N);
  } else if constexpr (M <= 6) {
    if (blocks == 4) {
      for (int64_t b = 0; b < 4; b += 2)
        fma_tile<M, 2>(x, K2, w + b * bs, y, N, n0 + b * kBlockN, N);
      return;
    }
  }
  for (int64_t b = 0; b < blocks; ++b)
    fma_tile<M, 1>(x, K2, w + b * bs, y, N, n0 + b * kBlockN, N);
}

// rows [0, M) of x (fp32) against `blocks` consecutive blocks at w. Up to 11 rows take one
// pass over the weights, every row count its own tile (read as 4 + 1, 6 + 1 and 8 + 1-3 rows,
// 5, 7 and 9-11 rows had cost a second pass from L2, of nearly a memory pass's time for one
// row: a tree of 5 tokens cost more than one of 6). More rows go 8 at a time and then the
// rest in one pass, the later passes from L2, where they are compute-bound and a wide tile
// computes slower (passes of 11-12 rows there cost a prefill's linears 8-30% more).
inline void fma_rows(const float* x, const uint32_t* w, int64_t K2, bf16* y, int64_t N,
                     int64_t n0, int64_t M, int64_t blocks) {
  for (int64_t m = 0; m < M;) {
    const int64_t take = M <= 11 ? M : std::min<int64_t>(M - m, 8);
    const float* xm = x + m * 2 * K2;
    bf16* ym = y + m * N;
    switch (take) {
      case 1: fma_pass<1>(xm, K2, w, ym, N, n0, blocks); break;
      case 2: fma_pass<2>(xm, K2, w, ym, N, n0, blocks); break;
      case 3: fma_pass<3>(xm, K2, w, ym, N, n0, blocks); break;
      case 4: fma_pass<4>(xm, K2, w, ym, N, n0, blocks); break;
      case 5: fma_pass<5>(xm, K2, w, ym, N, n0, blocks); break;
      case 6: fma_pass<6>(xm, K2, w, ym, N, n0, blocks); break;
      case 7: fma_pass<7>(xm, K2, w, ym, N, n0, blocks); break;
      case 8: fma_pass<8>(xm, K2, w, ym, N, n0, blocks); break;
      case 9: fma_pass<9>(xm, K2, w, ym, N, n0, blocks); break;
      case 10: fma_pass<10>(xm, K2, w, ym, N, n0, blocks); break;
      default: fma_pass<11>(xm, K2, w, ym, N, n0, blocks); break;
    }
    m += take;
  }
}

#else  // EAGLE2_AVX2: the same sums on 8 fp32 lanes (the 16-lane results, bit for bit but for
       // outputs below bf16's normal range, which vcvtneps2bf16 may flush to zero)

// fp32 -> bf16 bits, round to nearest even (c10::BFloat16's rounding), in the low 16 bits
inline __m256i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(
      _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}

inline __m256 round_bf16_8(__m256 v) {  // fp32 -> the nearest bf16 (even), as fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

// the first `count` (<= 8) of 8 floats, rounded, to out
inline void store_bf16_8(bf16* out, __m256 v, int64_t count) {
  const __m256i h = bf16_bits8(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h),
                                          _mm256_extracti128_si256(h, 1));
  if (count >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
  } else {
    alignas(16) bf16 tail[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tail), packed);
    std::copy(tail, tail + count, out);
  }
}

constexpr int kGroups8 = kBlockN / 8;  // 8-lane groups of outputs per block

// While the last pass over a block runs from L2, the next block is asked into L2, 128 bytes
// (its own k-th input pair) per input pair: the passes over it then compute from L2 instead of
// waiting on memory (paired runs over the target's linears here: 2-8 rows 9-14% faster).
inline void prefetch_pair(const uint32_t* next, int64_t k) {
  if (next == nullptr) return;
  _mm_prefetch(reinterpret_cast<const char*>(next + k * kBlockN), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(next + k * kBlockN + 16), _MM_HINT_T1);
}

// M rows against one block (M x 4 accumulators). Each input pair in two phases: every row's
// w[2j] x[2j] into all four groups, then every row's w[2j+1] x[2j+1] (each accumulator still
// adds the even product, then the odd one), so a phase keeps only M broadcast x values live
// and the loads stay few: for M = 1 and 2 (8 accumulators, no spills). Lean (for M = 3, 12
// accumulators, where the phases would spill): each group's weights widened and used at once,
// every x value broadcast where it is multiplied; the same sums in the same order, 16-20%
// faster for three rows than a pair and one more row (paired runs over the target's linears
// here). next: the block to prefetch (nullptr: none).
template <int M, bool Lean = false>
inline void fma_tile(const float* x, int64_t K2, const uint32_t* w, bf16* y, int64_t y_stride,
                     int64_t n0, int64_t N, const uint32_t* next) {
  __m256 acc[M][kGroups8];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kGroups8; ++r) acc[m][r] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K2; ++k) {
    const __m256i* wk = reinterpret_cast<const __m256i*>(w + k * kBlockN);
    const float* xk = x + 2 * k;
    prefetch_pair(next, k);
    if constexpr (Lean) {
      for (int r = 0; r < kGroups8; ++r) {
        const __m256i raw = _mm256_loadu_si256(wk + r);
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        for (int m = 0; m < M; ++m)
          acc[m][r] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(xk + m * 2 * K2), acc[m][r]);
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
        for (int m = 0; m < M; ++m)
          acc[m][r] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xk + m * 2 * K2 + 1), acc[m][r]);
      }
    } else {
      __m256 xb[M];
      for (int m = 0; m < M; ++m) xb[m] = _mm256_broadcast_ss(xk + m * 2 * K2);
      for (int r = 0; r < kGroups8; ++r) {
        const __m256 even =
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wk + r), 16));
        for (int m = 0; m < M; ++m) acc[m][r] = _mm256_fmadd_ps(even, xb[m], acc[m][r]);
      }
      for (int m = 0; m < M; ++m) xb[m] = _mm256_broadcast_ss(xk + m * 2 * K2 + 1);
      for (int r = 0; r < kGroups8; ++r) {
        const __m256 odd =
            _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wk + r), high));
        for (int m = 0; m < M; ++m) acc[m][r] = _mm256_fmadd_ps(odd, xb[m], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kGroups8; ++r) {
      const int64_t n = n0 + r * 8;
      if (n < N) store_bf16_8(y + m * y_stride + n, acc[m][r], N - n);
    }
}

// One row against B consecutive blocks (B x 4 accumulators, B streams: 4 streams read the
// weights ~7% faster than 2 here)
template <int B>
inline void fma_row(const float* x, int64_t K2, const uint32_t* w, bf16* y, int64_t n0,
                    int64_t N) {
  __m256 acc[B][kGroups8];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < kGroups8; ++r) acc[b][r] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K2; ++k) {
    const __m256 x0 = _mm256_broadcast_ss(x + 2 * k), x1 = _mm256_broadcast_ss(x + 2 * k + 1);
    for (int b = 0; b < B; ++b) {
      const uint32_t* wk = w + (b * K2 + k) * kBlockN;
      for (int r = 0; r < kGroups8; ++r) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 8 * r));
        acc[b][r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), x0,
                                    acc[b][r]);
        acc[b][r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(raw, high)), x1,
                                    acc[b][r]);
      }
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < kGroups8; ++r) {
      const int64_t n = n0 + b * kBlockN + r * 8;
      if (n < N) store_bf16_8(y + n, acc[b][r], N - n);
    }
}

// rows [0, M) of x (fp32) against B consecutive blocks at w; after: the block that follows
// them (nullptr: none). One row streams all B blocks at once; more rows take each block in
// turn, in passes of two rows (three when three are left) read from L2 after the first, the
// last pass prefetching the next block.
template <int B>
inline void fma_rows(const float* x, const uint32_t* w, int64_t K2, bf16* y, int64_t N,
                     int64_t n0, int64_t M, const uint32_t* after) {
  const int64_t bs = K2 * kBlockN;
  if (M == 1) {
    fma_row<B>(x, K2, w, y, n0, N);
    return;
  }
  for (int b = 0; b < B; ++b) {
    const uint32_t* wb = w + b * bs;
    const uint32_t* next = b + 1 < B ? wb + bs : after;
    const int64_t nb = n0 + b * kBlockN;
    for (int64_t m = 0; m < M;) {
      const int64_t left = M - m;
      const int64_t take = left == 3 ? 3 : left >= 2 ? 2 : 1;
      const uint32_t* pf = m + take >= M ? next : nullptr;
      const float* xm = x + m * 2 * K2;
      bf16* ym = y + m * N;
      if (take == 3) fma_tile<3, true>(xm, K2, wb, ym, N, nb, N, pf);
      else if (take == 2) fma_tile<2>(xm, K2, wb, ym, N, nb, N, pf);
      else fma_tile<1>(xm, K2, wb, ym, N, nb, N, pf);
      m += take;
    }
  }
}

#endif

// a contiguous bf16 tensor's values as fp32 (exact: a bf16 is the top half of its fp32),
// widened here rather than by an ATen conversion, whose three dispatched operations cost ~1 us
// a call (~0.1 ms of a forward's linears)
static std::vector<float> widened(const torch::Tensor& xc) {
  std::vector<float> out(static_cast<size_t>(xc.numel()));
  const auto* bits = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  for (size_t i = 0; i < out.size(); ++i) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(&out[i], &wide, 4);
  }
  return out;
}

// x [..., K] bf16, packed from pack_linear -> [..., out_features] bf16 by fp32 FMAs
torch::Tensor linear_fma(const torch::Tensor& x, const torch::Tensor& packed,
                         int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "linear_fma expects a bf16 CPU input");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockN && packed.scalar_type() == at::kInt &&
                  x.size(-1) == 2 * packed.size(1) &&
                  (out_features + kBlockN - 1) / kBlockN == packed.size(0),
              "linear_fma: the input's features or out_features do not match the packed weight");
  const auto xc = x.contiguous();
  const int64_t K2 = packed.size(1), N = out_features, blocks = packed.size(0);
  const int64_t M = xc.numel() / (2 * K2);
  const std::vector<float> xw = widened(xc);
  auto sizes = xc.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const float* xp = xw.data();
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  auto* yp = y.data_ptr<bf16>();
  parallel_blocks(blocks, [&](int64_t b0, int64_t b1) {
    // the blocks [b0, b1) four at a time, then one at a time; at(b): block b, nullptr past b1
    const auto at = [&](int64_t b) { return b < b1 ? wp + b * K2 * kBlockN : nullptr; };
    int64_t b = b0;
#ifdef EAGLE2_AVX512
    for (; b + 4 <= b1; b += 4) fma_rows(xp, at(b), K2, yp, N, b * kBlockN, M, 4);
    for (; b < b1; ++b) fma_rows(xp, at(b), K2, yp, N, b * kBlockN, M, 1);
#else
    for (; b + 4 <= b1; b += 4) fma_rows<4>(xp, at(b), K2, yp, N, b * kBlockN, M, at(b + 4));
    for (; b < b1; ++b) fma_rows<1>(xp, at(b), K2, yp, N, b * kBlockN, M, at(b + 1));
#endif
  });
  return y;
}


// ---- The bf16 linear on AMX tiles (Intel Xeon 4th generation and later) ----
// docs/cpu-backend.md "CPU performance". y = bf16(x @ w.T) by TDPBF16PS on the weight as
// pack_linear packs it: block b's pair rows [K2][32] uint32 are two VNNI B tiles per 32 inputs (16 pair rows
// of 16 outputs each, 128 bytes apart), so the FMA kernel's packed weight serves as it is. Each
// output is the tile unit's fp32 sum over the input pairs, 32 inputs a TDPBF16PS, in input
// order, from zero: a function of its row of x and the weight alone, so one row gives bitwise
// the same whatever rows come with it (exact verification), and up to 16 rows cost about what
// one costs (one tile multiply takes the 16 rows at once; the weights stream at the memory's
// rate). Rows past 16 take further 16-row groups while a block pair's weights are in L2. Needs
// K % 32 == 0 and the OS's permission for the tile data (`amx_ready`).
#ifdef EAGLE2_AMX
// bytes ahead of each block's stream asked into L1 (none: 12% slower at one row; 2, 6, 8 and
// 16 KB and the L2 hint within the spread)
constexpr int64_t kAmxPrefetch = 4096;

// rows [m0, m0 + rows) of y, outputs of blocks b and b + 1 (nb = 1 or 2)
inline void amx_blocks(const bf16* x, int64_t K, const uint32_t* w, int64_t K2, int nb,
                       bf16* y, int64_t N, int64_t n0, int rows) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const uint32_t* w1 = w + K2 * kBlockN;
  const char* end0 = reinterpret_cast<const char*>(w1);
  const char* end1 = reinterpret_cast<const char*>(w1 + K2 * kBlockN);
  for (int64_t k2 = 0; k2 < K2; k2 += 16) {
    const char* a = reinterpret_cast<const char*>(w + k2 * kBlockN) + kAmxPrefetch;
    const char* c = reinterpret_cast<const char*>(w1 + k2 * kBlockN) + kAmxPrefetch;
    for (int l = 0; l < 2048; l += 64) {  // this step's 2 KB a block, kAmxPrefetch ahead
      if (a + l < end0) _mm_prefetch(a + l, _MM_HINT_T0);
      if (nb == 2 && c + l < end1) _mm_prefetch(c + l, _MM_HINT_T0);
    }
    _tile_loadd(0, x + 2 * k2, K * 2);
    _tile_loadd(1, w + k2 * kBlockN, kBlockN * 4);
    _tile_loadd(2, w + k2 * kBlockN + 16, kBlockN * 4);
    _tile_dpbf16ps(4, 0, 1);
    _tile_dpbf16ps(5, 0, 2);
    if (nb == 2) {
      _tile_loadd(3, w1 + k2 * kBlockN, kBlockN * 4);
      _tile_loadd(1, w1 + k2 * kBlockN + 16, kBlockN * 4);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 0, 1);
    }
  }
  alignas(64) float sums[4][16][16];
  _tile_stored(4, sums[0], 64);
  _tile_stored(5, sums[1], 64);
  if (nb == 2) {
    _tile_stored(6, sums[2], 64);
    _tile_stored(7, sums[3], 64);
  }
  for (int t = 0; t < 2 * nb; ++t) {
    const int64_t col = n0 + 16 * t;
    if (col >= N) break;
    const __mmask16 mask = V::first(N - col);
    for (int m = 0; m < rows; ++m)
      _mm256_mask_storeu_epi16(y + m * N + col, mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums[t][m])));
  }
}
#endif

// x [..., K] bf16, packed from pack_linear -> [..., out_features] bf16 on the AMX tiles
torch::Tensor linear_amx(const torch::Tensor& x, const torch::Tensor& packed,
                         int64_t out_features) {
  TORCH_CHECK(amx_ready(), "linear_amx: this build or this machine has no AMX tiles");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "linear_amx expects a bf16 CPU input");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockN && packed.scalar_type() == at::kInt &&
                  x.size(-1) == 2 * packed.size(1) && x.size(-1) % 32 == 0 &&
                  (out_features + kBlockN - 1) / kBlockN == packed.size(0),
              "linear_amx: the input's features (a multiple of 32) or out_features do not "
              "match the packed weight");
#ifdef EAGLE2_AMX
  const auto xc = x.contiguous();
  const int64_t K2 = packed.size(1), K = 2 * K2, N = out_features, blocks = packed.size(0);
  const int64_t M = xc.numel() / K;
  auto sizes = xc.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const auto* xp = xc.data_ptr<bf16>();
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  auto* yp = y.data_ptr<bf16>();
  if (M == 0) return y;
  parallel_blocks((blocks + 1) / 2, [&](int64_t p0, int64_t p1) {
    int configured = 0;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = 2 * p;
      const int nb = b + 1 < blocks ? 2 : 1;
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
        if (rows != configured) configure_tiles(configured = rows);
        amx_blocks(xp + m0 * K, K, wp + b * K2 * kBlockN, K2, nb, yp + m0 * N, N, b * kBlockN,
                   rows);
      }
    }
    if (configured) _tile_release();
  });
  return y;
#else
  return torch::Tensor();
#endif
}

// o[i] = bf16(bf16(silu(g[i])) * u[i]), i < I (HF's act_fn(gate) * up in bf16), silu(g) =
// g * sigmoid(g) with sigmoid from exp(-|g|): every lane from its own value.
#ifdef EAGLE2_AVX512
inline void silu_mul_row(const bf16* g, const bf16* u, bf16* o, int64_t I) {
  for (int64_t i = 0; i < I; i += 32) {
    const __mmask32 mask = chunk_mask(I - i);
    __m512 glo, ghi, ulo, uhi;
    widen(g + i, mask, &glo, &ghi);
    widen(u + i, mask, &ulo, &uhi);
    __m512 res[2];
    const __m512 gs[2] = {glo, ghi}, us[2] = {ulo, uhi};
    for (int h = 0; h < 2; ++h) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gs[h])));
      const __m512 one = _mm512_set1_ps(1.0f);
      const __m512 denom = _mm512_add_ps(one, e);
      const __mmask16 neg = _mm512_cmp_ps_mask(gs[h], _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), denom);
      const __m512 act = round_bf16(_mm512_mul_ps(gs[h], sig));
      res[h] = _mm512_mul_ps(act, us[h]);
    }
    const __m512i packed = _mm512_inserti64x4(
        _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(res[0])),
        (__m256i)_mm512_cvtneps_pbh(res[1]), 1);
    _mm512_mask_storeu_epi16(o + i, mask, packed);
  }
}
#else
inline void silu_mul_row(const bf16* g, const bf16* u, bf16* o, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < I; i += 8) {
    const int64_t count = std::min<int64_t>(8, I - i);
    __m256 gv, uv;
    if (count == 8) {
      gv = widen8(g + i);
      uv = widen8(u + i);
    } else {
      alignas(16) bf16 gb[8] = {}, ub[8] = {};
      std::copy(g + i, g + i + count, gb);
      std::copy(u + i, u + i + count, ub);
      gv = widen8(gb);
      uv = widen8(ub);
    }
    const __m256 e = exp8(_mm256_sub_ps(zero, _mm256_andnot_ps(sign, gv)));
    const __m256 denom = _mm256_add_ps(one, e);
    const __m256 neg = _mm256_cmp_ps(gv, zero, _CMP_LT_OQ);
    const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), denom);
    const __m256 act = round_bf16_8(_mm256_mul_ps(gv, sig));
    store_bf16_8(o + i, _mm256_mul_ps(act, uv), count);
  }
}
#endif

// gate_up [..., 2I] bf16 -> [..., I] = silu_mul_row of each row's halves
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kBFloat16 &&
                  gate_up.size(-1) % 2 == 0, "silu_mul expects bf16 [..., 2I] on the CPU");
  const auto in = gate_up.contiguous();
  const int64_t I = in.size(-1) / 2, rows = in.numel() / (2 * I);
  auto sizes = in.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, in.options());
  const bf16* ip = in.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, row_grain(2 * I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(ip + r * 2 * I, ip + r * 2 * I + I, op + r * I, I);
  });
  return out;
}


// ---- A draft level's top-k log-probabilities ----
// logits [R, V] fp32 -> (the k largest log_softmax values of each row, descending, [R, k];
// their indices, int64): log_softmax(x)_i = x_i - m - log(sum_j exp(x_j - m)), m the row's
// maximum. One pass for the maximum, one that sums the exponentials (V::exp) while it keeps
// the k largest (an insertion into a sorted list of k: a value enters when it beats the
// k-th, so among equal values the first index ranks first). For the drafter
// (`Drafter._log_probs`), whose drafts need no exactness: torch's log_softmax and topk took
// ~45 us for two rows of 8192, this ~10.
std::tuple<torch::Tensor, torch::Tensor> top_log_probs(const torch::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() >= 1,
              "top_log_probs expects fp32 logits [..., V] on the CPU");
  const auto in = logits.contiguous();
  const int64_t V_ = in.size(-1), rows = V_ ? in.numel() / V_ : 0;
  TORCH_CHECK(k >= 1 && k <= V_, "top_log_probs: k must be in [1, ", V_, "], got ", k);
  auto sizes = in.sizes().vec();
  sizes.back() = k;
  auto values = torch::empty(sizes, in.options());
  auto indices = torch::empty(sizes, in.options().dtype(at::kLong));
  const float* ip = in.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* xp = indices.data_ptr<int64_t>();
  // rows of 64K logits or more a thread: waking a sleeping (passive) thread costs more than
  // a few rows of a draft vocabulary
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(V_, 1)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<float> top(k);
    std::vector<int64_t> at(k);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = ip + r * V_;
      V::F mv = V::set1(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + W <= V_; i += W) mv = V::max(V::load(x + i), mv);
      float m = -std::numeric_limits<float>::infinity();
      alignas(64) float lanes[W];
      V::store(lanes, mv);
      for (int l = 0; l < W; ++l) m = std::max(m, lanes[l]);
      for (; i < V_; ++i) m = std::max(m, x[i]);
      const V::F mb = V::set1(m);
      V::F sv = V::zero();
      int64_t n = 0;  // entries of top held
      float kth = -std::numeric_limits<float>::infinity();
      for (i = 0; i < V_; i += W) {
        const int64_t count = std::min<int64_t>(W, V_ - i);
        const V::F v = V::load_first(x + i, count, mb);
        sv = V::add(sv, V::keep_first(V::exp(V::sub(v, mb)), count));
        for (int64_t j = 0; j < count; ++j) {
          const float xv = x[i + j];
          if (n == k && !(xv > kth)) continue;
          int64_t pos = n < k ? n++ : k - 1;
          while (pos > 0 && top[pos - 1] < xv) {
            top[pos] = top[pos - 1];
            at[pos] = at[pos - 1];
            --pos;
          }
          top[pos] = xv;
          at[pos] = i + j;
          kth = top[n - 1];
        }
      }
      const float lse = m + std::log(V::sum(sv));
      for (int64_t j = 0; j < k; ++j) {
        vp[r * k + j] = top[j] - lse;
        xp[r * k + j] = at[j];
      }
    }
  });
  return {values, indices};
}

// ---- Greedy tokens of a bf16 linear (the lm_head) without all of its outputs ----
// docs/cpu-backend.md, "Exact greedy tokens". A greedy step needs only the argmax of each row's
// logits, where the logits are linear_fma's: bf16(the fp32 FMA sum over the input pairs, in
// order). One pass over an int8 copy of the weight (per-output scale s_i, Q = round(w / s_i))
// with the input quantized to int16 gives each logit to within a bound that holds for any
// input (Cauchy-Schwarz on the two quantization residues, plus the fp32 sum's rounding
// bound); every output whose upper bound, rounded to bf16, is below the largest lower bound,
// rounded to bf16, cannot be the argmax nor tie it, and the few that remain (~4 of 49,152 on
// SmolLM2) are computed exactly as linear_fma computes them. Half the bytes of the bf16
// weight, and 16 multiply-adds per instruction instead of 8, so the lm_head of a greedy
// step costs about half. The chosen token is bitwise torch.argmax of linear_fma's logits
// (ties: the lowest index).

constexpr int64_t kArgBlock = 32;  // outputs per block of the int8 weight (4 groups of 8 lanes)

// the fp32 FMA sum of K products: |f - exact| <= gamma |w|_2 |x|_2, gamma = 1.01 K 2^-24
inline double fma_sum_gamma(int64_t K) {
  return 1.01 * static_cast<double>(K) * std::ldexp(1.0, -24);
}

// weight [V, K] bf16 -> (int8 weight [blocks, K / 2, 32 outputs, 2], per output the float
// coefficients greedy_argmax's bounds read [3, V]: its scale s, the coefficient of |x|_2
// (|w - sQ|_2 + gamma |w|_2) and that of |x - s_x X|_2 (s |Q|_2), each rounded up by more than
// its roundings). Computed here once, not per call (49,152 outputs' doubles had cost ~0.3 ms
// a greedy step). The padding outputs of the last block are zero
std::tuple<torch::Tensor, torch::Tensor> pack_argmax(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.device().is_cpu() && weight.size(1) % 2 == 0,
              "pack_argmax expects a bf16 CPU weight [V, K] with K even");
  const auto w = weight.contiguous();
  const int64_t V = w.size(0), K = w.size(1), K2 = K / 2;
  const int64_t blocks = (V + kArgBlock - 1) / kArgBlock;
  auto q = torch::zeros({blocks, K2, kArgBlock, 2}, torch::dtype(torch::kInt8));
  auto stats = torch::zeros({3, V}, torch::dtype(torch::kFloat32));
  const bf16* wp = w.data_ptr<bf16>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = stats.data_ptr<float>();
  const double gamma = fma_sum_gamma(K);
  at::parallel_for(0, V, 256, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const bf16* row = wp + v * K;
      double top = 0.0;
      for (int64_t k = 0; k < K; ++k) top = std::max(top, std::fabs(static_cast<double>(row[k])));
      const double scale = top > 0.0 ? top / 127.0 : 1.0;
      double r2 = 0.0, q2 = 0.0, w2 = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double x = static_cast<double>(row[k]);
        const double qv = std::min(127.0, std::max(-127.0, std::nearbyint(x / scale)));
        const double r = x - scale * qv;
        r2 += r * r;
        q2 += qv * qv;
        w2 += x * x;
        qp[((v / kArgBlock) * K2 + k / 2) * kArgBlock * 2 + (v % kArgBlock) * 2 + k % 2] =
            static_cast<int8_t>(qv);
      }
      sp[v] = static_cast<float>(scale);
      sp[V + v] = static_cast<float>((std::sqrt(r2) + gamma * std::sqrt(w2)) * (1.0 + 1e-6));
      sp[2 * V + v] = static_cast<float>(scale * std::sqrt(q2) * (1.0 + 1e-6));
    }
  });
  return {q, stats};
}

#ifdef EAGLE2_AVX512
// int32 sums of M rows (M <= 8) against one block: out[m][32] = sum_k Q[o][k] X[m][k]. X as
// int16 pairs in int32 lanes (xpairs[m * K2 + k]); each input pair's 32 outputs widen to two
// vectors of 16 int16 pairs, and vpdpwssd (AVX512-VNNI; else vpmaddwd and an add) multiplies
// each lane's pair and adds both products to its sum: integers, so the same sums as the AVX2
// tile's in any order.
constexpr int64_t kArgRows = 8;
// bytes ahead of the input pair being read that are asked into L1 (one 64-byte line a pair)
constexpr int64_t kArgPrefetch = 4096;

template <int M>
inline void argmax_block(const int8_t* qb, int64_t K2, const int32_t* xpairs, int32_t* out) {
  __m512i acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K2; ++k) {
    const int8_t* qk = qb + k * kArgBlock * 2;
    _mm_prefetch(reinterpret_cast<const char*>(qk + kArgPrefetch), _MM_HINT_T0);
    __m512i wv[2];
    for (int g = 0; g < 2; ++g)
      wv[g] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qk + 32 * g)));
    for (int m = 0; m < M; ++m) {
      const __m512i xb = _mm512_set1_epi32(xpairs[m * K2 + k]);
      for (int g = 0; g < 2; ++g) {
#ifdef __AVX512VNNI__
        acc[m][g] = _mm512_dpwssd_epi32(acc[m][g], wv[g], xb);
#else
        acc[m][g] = _mm512_add_epi32(acc[m][g], _mm512_madd_epi16(wv[g], xb));
#endif
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < 2; ++g)
      _mm512_storeu_si512(out + m * kArgBlock + g * 16, acc[m][g]);
}

#else  // EAGLE2_AVX2
// int32 sums of M rows (M <= 4) against one block: out[m][32] = sum_k Q[o][k] X[m][k]. X as
// int16 pairs in int32 lanes (xpairs[m * K2 + k]); vpmaddwd multiplies each lane's pair and
// adds the two products. G groups of 8 outputs from group g0.
constexpr int64_t kArgRows = 4;

template <int M, int G>
inline void argmax_tile(const int8_t* qb, int64_t K2, const int32_t* xpairs, int g0,
                        int32_t* out) {
  __m256i acc[M][G];
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K2; ++k) {
    const int8_t* qk = qb + k * kArgBlock * 2 + g0 * 16;
    __m256i wv[G];
    for (int g = 0; g < G; ++g)
      wv[g] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qk + 16 * g)));
    for (int m = 0; m < M; ++m) {
      const __m256i xb = _mm256_set1_epi32(xpairs[m * K2 + k]);
      for (int g = 0; g < G; ++g)
        acc[m][g] = _mm256_add_epi32(acc[m][g], _mm256_madd_epi16(wv[g], xb));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * kArgBlock + (g0 + g) * 8),
                          acc[m][g]);
}

template <int M>
inline void argmax_block(const int8_t* qb, int64_t K2, const int32_t* xpairs, int32_t* out) {
  if constexpr (M <= 2) {
    argmax_tile<M, 4>(qb, K2, xpairs, 0, out);
  } else {
    argmax_tile<M, 2>(qb, K2, xpairs, 0, out);
    argmax_tile<M, 2>(qb, K2, xpairs, 2, out);
  }
}
#endif

// the bf16 value (RNE, as linear_fma stores it) of the fp32 FMA sum linear_fma computes for
// output v: each input pair's even product, then its odd one, in order. wv: output v's row of
// the bf16 weight [V, K] as K / 2 pairs (even feature in the low half, as pack_linear pairs
// them), read where it lies contiguous rather than from the packed weight, where one output's
// pairs are 128 bytes apart (a cache line for each 4 bytes read)
inline float fma_output(const uint32_t* wv, int64_t K2, const float* x) {
  float acc = 0.0f;
  for (int64_t k = 0; k < K2; ++k) {
    const uint32_t pair = wv[k], lo = pair << 16, hi = pair & 0xFFFF0000u;
    float even, odd;
    std::memcpy(&even, &lo, 4);
    std::memcpy(&odd, &hi, 4);
    acc = std::fma(even, x[2 * k], acc);
    acc = std::fma(odd, x[2 * k + 1], acc);
  }
  return static_cast<float>(bf16(acc));
}

#ifdef EAGLE2_AMX
// int32 sums of `rows` rows (<= 16) against one block of 32 outputs on the AMX tiles: out[m][o]
// = 128 (Q . Xh[m]) + Q . Xl[m] = Q . X[m]. qt: the block in pack_argmax_tiles' layout (two
// halves of 16 outputs, each [K / 4][16][4]); xh, xl: the rows' int8 parts, K apart.
// tmm0 / tmm1: the parts, tmm2 / tmm3: the halves' weights, tmm4-7: the four sums
inline void argmax_tiles(const int8_t* qt, int64_t K, const int8_t* xh, const int8_t* xl,
                         int rows, int32_t* out) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const int8_t* q1 = qt + 16 * K;
  for (int64_t k = 0; k < K; k += 64) {
    _tile_loadd(2, qt + k * 16, 64);
    _tile_loadd(3, q1 + k * 16, 64);
    _tile_loadd(0, xh + k, K);
    _tile_loadd(1, xl + k, K);
    _tile_dpbssd(4, 0, 2);
    _tile_dpbssd(5, 1, 2);
    _tile_dpbssd(6, 0, 3);
    _tile_dpbssd(7, 1, 3);
  }
  alignas(64) int32_t part[4][16][16];
  _tile_stored(4, part[0], 64);  // (tile numbers are immediates)
  _tile_stored(5, part[1], 64);
  _tile_stored(6, part[2], 64);
  _tile_stored(7, part[3], 64);
  for (int m = 0; m < rows; ++m)
    for (int h = 0; h < 2; ++h) {
      const __m512i sum = _mm512_add_epi32(
          _mm512_slli_epi32(_mm512_load_si512(part[2 * h][m]), 7),
          _mm512_load_si512(part[2 * h + 1][m]));
      _mm512_storeu_si512(out + m * kArgBlock + 16 * h, sum);
    }
}
#endif

// q from pack_argmax [blocks, K / 2, 32, 2] -> the same int8 weight as AMX B tiles: per block
// two halves of 16 outputs, each [K / 4][16 outputs][4 inputs] (TDPBSSD's layout); empty where
// this build or machine has no AMX tiles or K is not a multiple of 64
torch::Tensor pack_argmax_tiles(const torch::Tensor& q) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == kArgBlock && q.size(3) == 2 &&
                  q.scalar_type() == at::kChar, "pack_argmax_tiles expects pack_argmax's q");
  const int64_t blocks = q.size(0), K2 = q.size(1), K = 2 * K2;
  if (!amx_ready() || K % 64) return torch::empty({0}, q.options());
  const auto qc = q.contiguous();
  auto out = torch::empty({blocks, 2, K / 4, 16, 4}, q.options());
  const int8_t* src = qc.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t o = 0; o < kArgBlock; ++o)
        for (int64_t k = 0; k < K; ++k)
          dst[(((b * 2 + o / 16) * (K / 4) + k / 4) * 16 + o % 16) * 4 + k % 4] =
              src[((b * K2 + k / 2) * kArgBlock + o) * 2 + k % 2];
  });
  return out;
}

#ifdef EAGLE2_AVX512
// fma_output of 16 outputs vs[0..16) at once, one per lane: each lane's pairs gathered from its
// row of the weight (rows: [V, K / 2] pairs), the same FMAs in the same order as fma_output's,
// rounded to bf16 (RNE). A lane reads its row's cache lines in order, 16 pairs a line
inline void fma_outputs16(const uint32_t* rows, int64_t K2, const int64_t* vs, const float* x,
                          float* out) {
  alignas(64) int32_t at[16];
  for (int l = 0; l < 16; ++l) at[l] = static_cast<int32_t>(vs[l] * K2);
  __m512i idx = _mm512_load_si512(at);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m512i pair = _mm512_i32gather_epi32(idx, rows, 4);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)),
                          _mm512_set1_ps(x[2 * k]), acc);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(pair, high)),
                          _mm512_set1_ps(x[2 * k + 1]), acc);
    idx = _mm512_add_epi32(idx, one);
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, acc);
  for (int l = 0; l < 16; ++l) out[l] = static_cast<float>(bf16(sums[l]));
}
#endif

// x [R, K] bf16 (R rows of final hidden states), q/stats from pack_argmax of weight (the bf16
// lm_head weight [V, K] itself) -> [R] int64: the argmax of linear_fma(x, pack_linear(weight),
// V) per row,
// or -1 for a row whose input is not finite (the caller computes the logits then)
torch::Tensor greedy_argmax(const torch::Tensor& x, const torch::Tensor& q,
                            const torch::Tensor& stats, const torch::Tensor& weight, int64_t V,
                            const std::optional<torch::Tensor>& q_tiles, int64_t tile_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "greedy_argmax expects bf16 [R, K] on the CPU");
  const int64_t R = x.size(0), K = x.size(1), K2 = K / 2;
  TORCH_CHECK(q.dim() == 4 && q.size(1) == K2 && q.size(2) == kArgBlock &&
                  q.size(0) * kArgBlock >= V && stats.dim() == 2 && stats.size(0) == 3 &&
                  stats.size(1) == V && stats.scalar_type() == at::kFloat &&
                  weight.dim() == 2 && weight.size(0) == V && weight.size(1) == K &&
                  weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  K % 2 == 0,
              "greedy_argmax: the input's features or V do not match the weights");
  const std::vector<float> xf = widened(x.contiguous());
  const auto st = stats.contiguous();
  const float* xp = xf.data();
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* wp = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  const int64_t blocks = q.size(0);
  // the input's int16 range: the int32 sums cannot overflow (127 x X x K < 2^31), and each
  // value splits into two int8 parts X = 128 Xh + Xl, |Xh| <= 127 (the AMX pass below)
  const double xmax = std::min(16256.0, std::floor(2147483647.0 / (127.0 * K)));
  auto result = torch::full({R}, -1, torch::dtype(torch::kInt64));
  int64_t* rp = result.data_ptr<int64_t>();
  // per row: the int16 input (pairs in int32 lanes, vpmaddwd's operand), its scale s_x, |x|_2
  // and the quantization residue's |x - s_x X|_2
  std::vector<int32_t> xpairs(R * K2);
  std::vector<float> sx(R), xn(R), en(R);
  std::vector<char> ok(R, 0);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = xp + r * K;
    double top = 0.0, x2 = 0.0, e2 = 0.0;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite = finite && std::isfinite(row[k]);
      top = std::max(top, std::fabs(static_cast<double>(row[k])));
      x2 += static_cast<double>(row[k]) * row[k];
    }
    if (!finite) continue;
    ok[r] = 1;
    const double s = top > 0.0 ? top / xmax : 1.0;
    for (int64_t k = 0; k < K2; ++k) {
      uint32_t halves[2];
      for (int h = 0; h < 2; ++h) {
        const double v = row[2 * k + h];
        const double xq = std::min(xmax, std::max(-xmax, std::nearbyint(v / s)));
        e2 += (v - s * xq) * (v - s * xq);
        halves[h] = static_cast<uint16_t>(static_cast<int16_t>(xq));
      }
      xpairs[r * K2 + k] = static_cast<int32_t>(halves[0] | (halves[1] << 16));
    }
    // as floats, rounded up by more than their roundings (s_x enters only the estimate)
    sx[r] = static_cast<float>(s);
    xn[r] = static_cast<float>(std::sqrt(x2) * (1.0 + 1e-6));
    en[r] = static_cast<float>(std::sqrt(e2) * (1.0 + 1e-6));
  }
  // per output: its scale and the bound's coefficients of |x|_2 and |x - s_x X|_2
  const float* scale = st.data_ptr<float>();
  const float* coef_x = scale + V;
  const float* coef_e = scale + 2 * V;
  // pass 1: the int32 sums -> each output's bounds: estimate -/+ margin. No output whose bf16
  // logit can be below floor (the largest lower bound, rounded as the logits are) can win or
  // tie; an upper bound <= thr(floor) (at most the bf16 value below floor: bf16 keeps 8
  // significant bits) rounds below it. The outputs above thr are the candidates, computed
  // exactly in pass 2. In float: each of the ~8 roundings is within 2^-24 of its result, and
  // 1e-6 x (|estimate| + bound) more covers them all
  auto thr_of = [](float floor) {
    const float floor_bf16 = static_cast<float>(bf16(floor));
    return floor_bf16 - std::fabs(floor_bf16) * (1.0f / 128.0f) - 1e-30f;
  };
#ifdef EAGLE2_AVX512
  const __m512 rel = _mm512_set1_ps(1e-6f), tiny = _mm512_set1_ps(1e-30f);
#else
  const __m256 rel = _mm256_set1_ps(1e-6f), tiny = _mm256_set1_ps(1e-30f);
  const __m256 sign = _mm256_set1_ps(-0.0f), none = _mm256_set1_ps(-INFINITY);
#endif
  // a screen before the bounds: per row, the bound with the largest coefficients of all
  // outputs, which no output's exceeds (the same float operations on larger non-negative
  // operands: rounding is monotone), so est + that margin <= thr proves upper <= thr with the
  // output's own coefficients unread. A thread keeps its running floor (at most the final
  // one, so its thr is too, and what it keeps is a superset); the first blocks screen little,
  // then nearly every output is out after the estimate alone. The floor is exact: an output
  // whose lower bound could raise it has est >= lower > thr and passes the screen
  __m256 tops_x = _mm256_setzero_ps(), tops_e = _mm256_setzero_ps();
  int64_t v8 = 0;
  for (; v8 + 8 <= V; v8 += 8) {
    tops_x = _mm256_max_ps(tops_x, _mm256_loadu_ps(coef_x + v8));
    tops_e = _mm256_max_ps(tops_e, _mm256_loadu_ps(coef_e + v8));
  }
  alignas(32) float tx[8], te[8];
  _mm256_store_ps(tx, tops_x);
  _mm256_store_ps(te, tops_e);
  float top_cx = *std::max_element(tx, tx + 8), top_ce = *std::max_element(te, te + 8);
  for (; v8 < V; ++v8) {
    top_cx = std::max(top_cx, coef_x[v8]);
    top_ce = std::max(top_ce, coef_e[v8]);
  }
  std::vector<float> screen(R);
  for (int64_t r = 0; r < R; ++r) screen[r] = top_cx * xn[r] + top_ce * en[r];
  // the blocks in equal contiguous shares, kPieces tasks a thread taken in turn (as
  // parallel_blocks takes its pieces), each task its own floors and candidates: the final
  // floor is their maximum and the candidates their union (each output in one task), whatever
  // the split
  struct Found {
    int64_t v;
    float upper;
  };
  const int64_t tasks =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads() * kPieces, blocks));
  std::vector<float> task_floor(tasks * R, -INFINITY);
  std::vector<std::vector<Found>> task_found(tasks * R);
#ifdef EAGLE2_AMX
  // the same int32 sums on the AMX tiles (TDPBSSD: int8 x int8), up to 16 rows a pass, from
  // the input's two int8 parts: sum = 128 (Q . Xh) + Q . Xl exactly, so the bounds, and the
  // token, are the VNNI pass's whichever runs (tile_rows: from how many rows)
  const bool tiles = q_tiles.has_value() && q_tiles->numel() && R >= tile_rows &&
                     K % 64 == 0 && amx_ready();
  std::vector<int8_t> xhl;
  if (tiles) {
    TORCH_CHECK(q_tiles->scalar_type() == at::kChar &&
                    q_tiles->numel() == blocks * kArgBlock * K,
                "greedy_argmax: the tile copy does not match the int8 weight");
    xhl.resize(2 * R * K);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t pair = static_cast<uint32_t>(xpairs[r * K2 + k / 2]);
        const int32_t v = static_cast<int16_t>(k % 2 ? pair >> 16 : pair & 0xFFFF);
        const int32_t hi = (v + 64) >> 7;  // floor((v + 64) / 128)
        xhl[r * K + k] = static_cast<int8_t>(hi);
        xhl[(R + r) * K + k] = static_cast<int8_t>(v - 128 * hi);
      }
  }
#else
  const bool tiles = false;
#endif
  // a block's rows go kArgRows (or 16 on the tiles) at a time while its weights stay in L1
  // (18 KB for the embedded model): more rows read the weights from memory once, not once a
  // group (two threads, 16 rows: 4.1 ms, caches flushed, against 1.9 for 8, when every group
  // streamed the whole lm_head)
  const int64_t group = tiles ? 16 : kArgRows;
  parallel_pieces(tasks, 1, [&](int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b0 = blocks * t / tasks, b1 = blocks * (t + 1) / tasks;
    float* floors = task_floor.data() + t * R;
    std::vector<Found>* found = task_found.data() + t * R;
    std::vector<float> thrs(R, -INFINITY);
    alignas(64) int32_t sums[16 * kArgBlock];
    int configured = 0;
    // row r's bounds of outputs v .. v + width - 1 (the lanes set in live): the floor raised
    // to their largest lower bound, and the outputs whose upper bound clears its thr kept
    const auto keep = [&](int64_t r, int64_t v, const float* up, float lowest, unsigned live,
                          int width) {
      if (lowest > floors[r]) {
        floors[r] = lowest;
        thrs[r] = thr_of(lowest);
      }
      for (int l = 0; l < width; ++l)
        if (((live >> l) & 1) && up[l] > thrs[r]) found[r].push_back({v + l, up[l]});
    };
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* qb = qp + b * K2 * kArgBlock * 2;
      for (int64_t r0 = 0; r0 < R; r0 += group) {
        const int64_t rows = std::min<int64_t>(group, R - r0);
        const int32_t* xr = xpairs.data() + r0 * K2;
#ifdef EAGLE2_AMX
        if (tiles) {
          if (rows != configured) configure_tiles(configured = static_cast<int>(rows), 2);
          argmax_tiles(q_tiles->data_ptr<int8_t>() + b * kArgBlock * K, K,
                       xhl.data() + r0 * K, xhl.data() + (R + r0) * K, static_cast<int>(rows),
                       sums);
        }
#endif
        if (!tiles) switch (rows) {
          case 1: argmax_block<1>(qb, K2, xr, sums); break;
          case 2: argmax_block<2>(qb, K2, xr, sums); break;
          case 3: argmax_block<3>(qb, K2, xr, sums); break;
#ifdef EAGLE2_AVX512
          case 4: argmax_block<4>(qb, K2, xr, sums); break;
          case 5: argmax_block<5>(qb, K2, xr, sums); break;
          case 6: argmax_block<6>(qb, K2, xr, sums); break;
          case 7: argmax_block<7>(qb, K2, xr, sums); break;
          default: argmax_block<8>(qb, K2, xr, sums); break;
#else
          default: argmax_block<4>(qb, K2, xr, sums); break;
#endif
        }
        const int64_t v0 = b * kArgBlock, n = std::min<int64_t>(kArgBlock, V - v0);
#ifdef EAGLE2_AVX512
        // the same float operations per lane as the AVX2 build's 8-lane loop (#else), 16
        // outputs at a time and every row of the group against each 16 (their scales read
        // once for all rows): at 12 rows that loop, a row at a time, had taken ~40% of the
        // pass. A row's floor follows its lower bounds every 16 outputs, not 8: what a row
        // keeps may be a larger superset, cut to the same candidates by the final floor in
        // pass 2, so the token is the same
        for (int64_t j = 0; j < n; j += 16) {
          const int64_t v = v0 + j;
          const __mmask16 lanes = V::first(n - j);
          const __m512 sc = _mm512_maskz_loadu_ps(lanes, scale + v);
          __m512 cx = _mm512_setzero_ps(), ce = _mm512_setzero_ps();
          bool coefs = false;
          for (int64_t m = 0; m < rows; ++m) {
            const int64_t r = r0 + m;
            const __m512 vscreen = _mm512_set1_ps(screen[r]);
            const __m512 estimate = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + m * kArgBlock + j)),
                _mm512_mul_ps(sc, _mm512_set1_ps(sx[r])));
            const __m512 wide = _mm512_add_ps(estimate, _mm512_add_ps(vscreen, _mm512_add_ps(
                _mm512_mul_ps(rel, _mm512_add_ps(_mm512_abs_ps(estimate), vscreen)), tiny)));
            if (!_mm512_mask_cmp_ps_mask(lanes, wide, _mm512_set1_ps(thrs[r]), _CMP_GT_OQ))
              continue;
            if (!coefs) {
              cx = _mm512_maskz_loadu_ps(lanes, coef_x + v);
              ce = _mm512_maskz_loadu_ps(lanes, coef_e + v);
              coefs = true;
            }
            const __m512 bound = _mm512_add_ps(_mm512_mul_ps(cx, _mm512_set1_ps(xn[r])),
                                               _mm512_mul_ps(ce, _mm512_set1_ps(en[r])));
            const __m512 margin = _mm512_add_ps(bound, _mm512_add_ps(_mm512_mul_ps(
                rel, _mm512_add_ps(_mm512_abs_ps(estimate), bound)), tiny));
            alignas(64) float up[16];
            _mm512_store_ps(up, _mm512_add_ps(estimate, margin));
            const float lowest = _mm512_reduce_max_ps(_mm512_mask_blend_ps(
                lanes, _mm512_set1_ps(-INFINITY), _mm512_sub_ps(estimate, margin)));
            keep(r, v, up, lowest, lanes, 16);
          }
        }
#else
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t r = r0 + m;
          const __m256 vsx = _mm256_set1_ps(sx[r]), vxn = _mm256_set1_ps(xn[r]);
          const __m256 ven = _mm256_set1_ps(en[r]), vscreen = _mm256_set1_ps(screen[r]);
          for (int64_t j = 0; j < n; j += 8) {
            const int64_t v = v0 + j;
            const __m256i lanes = _mm256_cmpgt_epi32(
                _mm256_set1_epi32(static_cast<int>(n - j)),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const __m256 sc = _mm256_maskload_ps(scale + v, lanes);
            const __m256 estimate = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_load_si256(
                    reinterpret_cast<const __m256i*>(sums + m * kArgBlock + j))),
                _mm256_mul_ps(sc, vsx));
            const __m256 wide = _mm256_add_ps(estimate, _mm256_add_ps(vscreen, _mm256_add_ps(
                _mm256_mul_ps(rel, _mm256_add_ps(_mm256_andnot_ps(sign, estimate), vscreen)),
                tiny)));
            const int live = _mm256_movemask_ps(_mm256_castsi256_ps(lanes));
            if (!(_mm256_movemask_ps(_mm256_cmp_ps(wide, _mm256_set1_ps(thrs[r]), _CMP_GT_OQ)) &
                  live))
              continue;
            const __m256 cx = _mm256_maskload_ps(coef_x + v, lanes);
            const __m256 ce = _mm256_maskload_ps(coef_e + v, lanes);
            const __m256 bound = _mm256_add_ps(_mm256_mul_ps(cx, vxn),
                                               _mm256_mul_ps(ce, ven));
            const __m256 margin = _mm256_add_ps(bound, _mm256_add_ps(_mm256_mul_ps(
                rel, _mm256_add_ps(_mm256_andnot_ps(sign, estimate), bound)), tiny));
            alignas(32) float up[8], low[8];
            _mm256_store_ps(up, _mm256_add_ps(estimate, margin));
            _mm256_store_ps(low, _mm256_blendv_ps(none, _mm256_sub_ps(estimate, margin),
                                                  _mm256_castsi256_ps(lanes)));
            const float lowest = *std::max_element(low, low + 8);
            keep(r, v, up, lowest, live, 8);
          }
        }
#endif
      }
    }
#ifdef EAGLE2_AMX
    if (configured) _tile_release();
#else
    (void)configured;
#endif
  }
  });
  // pass 2: per row, the tasks' candidates above the final thr, exactly. Rows are
  // independent: split over the threads (a row's exact rescoring is the same on any thread)
  // the weight's pair offsets fit the gathers' int32 indices
  const bool pairs_fit = V * K2 <= std::numeric_limits<int32_t>::max();
  (void)pairs_fit;
  at::parallel_for(0, R, 1, [&](int64_t ra, int64_t rb) {
  for (int64_t r = ra; r < rb; ++r) {
    if (!ok[r]) continue;
    float best_lower = -INFINITY;
    for (int64_t t = 0; t < tasks; ++t) best_lower = std::max(best_lower, task_floor[t * R + r]);
    const float row_thr = thr_of(best_lower);
    const float* row = xp + r * K;
    float best = -INFINITY;
    int64_t arg = -1;
    std::vector<int64_t> cands;  // ascending: the tasks' shares in order, each ascending
    for (int64_t t = 0; t < tasks; ++t)
      for (const Found& f : task_found[t * R + r])
        if (f.upper > row_thr) cands.push_back(f.v);
    // the candidates' exact logits, in ascending order: 16 at a time, one per lane, where
    // this build has AVX-512 (each lane the same FMAs in the same order as fma_output)
    std::vector<float> logits(cands.size());
    size_t done = 0;
#ifdef EAGLE2_AVX512
    if (pairs_fit) {
      for (; done + 16 <= cands.size(); done += 16)
        fma_outputs16(wp, K2, cands.data() + done, row, logits.data() + done);
    }
#endif
    for (size_t c = done; c < cands.size(); ++c)
      logits[c] = fma_output(wp + cands[c] * K2, K2, row);
    for (size_t c = 0; c < cands.size(); ++c) {
      if (arg < 0 || logits[c] > best) {  // ties: the lowest index, as torch.argmax
        best = logits[c];
        arg = cands[c];
      }
    }
    rp[r] = arg;
  }
  });
  return result;
}

// The instruction set this build uses: "avx512_bf16" or "avx2"
std::string isa() {
#ifdef EAGLE2_AVX512
  return "avx512_bf16";
#else
  return "avx2";
#endif
}

// One decoder layer (RMSNorm, q|k|v, RoPE and the K/V writes, exact attention, o, residual add
// and norm, gate|up, SiLU x up, down, residual add) as the Python path `fused._native_layer`
// calls the operators above one by one, in the same order on the same tensors: bitwise its
// result, without the ~10 dispatched calls and the Python between them (docs/cpu-backend.md "CPU
// performance"). The linears are linear_fma's (packed from pack_linear). Each step is a
// RECORD_FUNCTION under its operator's name, so the profiler still splits the time by kernel.
// An empty input_norm: no input norm (an EAGLE draft head's layer, `fused.native_head_layer`);
// amx: the linears by linear_amx (the same packed weights).
torch::Tensor decoder_layer(const torch::Tensor& x, const torch::Tensor& input_norm,
                            const torch::Tensor& post_norm, double eps,
                            const torch::Tensor& qkv_w, int64_t qkv_features,
                            const torch::Tensor& o_w, int64_t o_features,
                            const torch::Tensor& gate_up_w, int64_t gate_up_features,
                            const torch::Tensor& down_w, int64_t down_features,
                            const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_q,
                            int64_t num_kv, torch::Tensor cache_k, torch::Tensor cache_v,
                            const torch::Tensor& slots, const torch::Tensor& write_pos,
                            const torch::Tensor& base, const torch::Tensor& tree_mask,
                            double scale, const std::optional<torch::Tensor>& key_blocks,
                            const std::optional<torch::Tensor>& key_blocks_valid, bool amx,
                            const std::optional<torch::Tensor>& block_tables) {
  const std::vector<c10::IValue> no_inputs;
  auto fma = [&](const torch::Tensor& in, const torch::Tensor& w, int64_t features) {
    if (amx) {
      RECORD_FUNCTION("eagle2_cpu::linear_amx", no_inputs);
      return linear_amx(in, w, features);
    }
    RECORD_FUNCTION("eagle2_cpu::linear_fma", no_inputs);
    return linear_fma(in, w, features);
  };
  torch::Tensor h, q, out, res;
  if (input_norm.numel()) {
    RECORD_FUNCTION("eagle2_cpu::rms_norm", no_inputs);
    h = rms_norm(x.contiguous(), input_norm, eps);
  } else {  // no input norm (an EAGLE head's layer: `fused.native_head_layer`)
    h = x.contiguous();
  }
  const auto qkv = fma(h, qkv_w, qkv_features);
  {
    RECORD_FUNCTION("eagle2_cpu::qkv_rope_write", no_inputs);
    q = qkv_rope_write(qkv, cos, sin, num_q, num_kv, cache_k, cache_v, slots, write_pos,
                       block_tables);
  }
  {
    RECORD_FUNCTION("eagle2_cpu::attention", no_inputs);
    out = attention(q, cache_k, cache_v, slots, base, tree_mask, scale, key_blocks,
                    key_blocks_valid, block_tables);
  }
  const auto delta = fma(out, o_w, o_features);
  {
    RECORD_FUNCTION("eagle2_cpu::add_rms_norm", no_inputs);
    std::tie(res, h) = add_rms_norm(x, delta, post_norm, eps);
  }
  const auto gate_up = fma(h, gate_up_w, gate_up_features);
  torch::Tensor act;
  {
    RECORD_FUNCTION("eagle2_cpu::silu_mul", no_inputs);
    act = silu_mul(gate_up);
  }
  auto y = fma(act, down_w, down_features);
  {
    // the residual add in place, bitwise aten::add of the two bf16 tensors (RNE of the fp32
    // sum, as `add_rms_norm`'s) without its dispatch and iterator (~5 us a layer)
    RECORD_FUNCTION("eagle2_cpu::residual_add", no_inputs);
    if (!res.is_contiguous() || res.sizes() != y.sizes()) return res + y;
    const bf16* rp = res.data_ptr<bf16>();
    bf16* yp = y.data_ptr<bf16>();
    const int64_t n = y.numel();
    at::parallel_for(0, n, 8192, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        yp[i] = bf16(static_cast<float>(rp[i]) + static_cast<float>(yp[i]));
    });
  }
  return y;
}

// Consecutive decoder layers of the target, first_layer .. first_layer + L - 1, as one operator:
// `decoder_layer` for each in turn, so bitwise the per-layer calls `fused._native_layer`
// makes, without the dispatch of a 26-argument operator and the Python between layers
// (~12 us a layer: ~0.35 ms of a 9 ms one-token forward of a 30-layer model; docs/cpu-backend.md
// "CPU performance"). The lists hold one tensor per layer (input and post norms, the packed
// q|k|v, o, gate|up and down weights); cache_k / cache_v [num_layers, slots, KVH, S, Dh(+1)]
// and key_blocks / key_blocks_valid (empty: none) are the whole cache, indexed by layer.
torch::Tensor decoder_layers(
    const torch::Tensor& x, at::TensorList input_norms, at::TensorList post_norms, double eps,
    at::TensorList qkv_w, int64_t qkv_features, at::TensorList o_w, int64_t o_features,
    at::TensorList gate_up_w, int64_t gate_up_features, at::TensorList down_w,
    int64_t down_features, const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_q,
    int64_t num_kv, torch::Tensor cache_k, torch::Tensor cache_v, int64_t first_layer,
    const torch::Tensor& slots, const torch::Tensor& write_pos, const torch::Tensor& base,
    const torch::Tensor& tree_mask, double scale, const std::optional<torch::Tensor>& key_blocks,
    const std::optional<torch::Tensor>& key_blocks_valid, bool amx,
    const std::optional<torch::Tensor>& block_tables) {
  const size_t L = input_norms.size();
  TORCH_CHECK(post_norms.size() == L && qkv_w.size() == L && o_w.size() == L &&
                  gate_up_w.size() == L && down_w.size() == L,
              "decoder_layers: one norm and packed weight of each kind per layer");
  TORCH_CHECK(first_layer >= 0 && first_layer + static_cast<int64_t>(L) <= cache_k.size(0) &&
                  cache_v.size(0) == cache_k.size(0),
              "decoder_layers: layers ", first_layer, "..", first_layer + L, " beyond the "
              "cache's ", cache_k.size(0));
  const bool blocks = key_blocks.has_value() && key_blocks->numel();
  auto h = x;
  for (size_t j = 0; j < L; ++j) {
    const int64_t i = first_layer + static_cast<int64_t>(j);
    std::optional<torch::Tensor> kb, kbv;
    if (blocks) {
      kb = key_blocks->select(0, i);
      kbv = key_blocks_valid->select(0, i);
    }
    h = decoder_layer(h, input_norms[j], post_norms[j], eps, qkv_w[j], qkv_features, o_w[j],
                      o_features, gate_up_w[j], gate_up_features, down_w[j], down_features, cos,
                      sin, num_q, num_kv, cache_k.select(0, i), cache_v.select(0, i), slots,
                      write_pos, base, tree_mask, scale, kb, kbv, amx, block_tables);
  }
  return h;
}

// One call of an EAGLE-1/2 draft head as one operator (docs/cpu-backend.md "CPU performance"): the
// embeddings of `tokens` [B, N] beside `features` [B, N, H] -> fc -> `decoder_layer` (no input
// norm: the fc's output is both the projections' input and the residual) over the head's cache,
// and, with k > 0, the top-k log-probs of the draft vocabulary (`top_log_probs` of the vocab
// linear's fp32 logits; d2t maps them to target tokens) for every output row, or for one row a
// request (`logit_rows`). The same calls in the same order as `Drafter._run` +
// `Drafter._log_probs` make one by one on this path, so bitwise their result, without the ~40
// dispatched operations and the Python around them that cost more than the head's arithmetic
// at the few rows of a draft level. RoPE rows are
// taken at `positions` [B, N] from the tables [S, Dh]; the N new entries are written at the
// end of the tree mask's columns (base + T - N ..); append_eye: the mask given is the nodes'
// ancestors [B, N, T0] and each node also sees itself (-> [B, N, T0 + N], returned). Each
// linear by linear_amx where its flag says so, else linear_fma (the same packed weights).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> head_step(
    const torch::Tensor& tokens, const torch::Tensor& features, const torch::Tensor& embed,
    const torch::Tensor& fc_w, int64_t fc_features, bool fc_amx, const torch::Tensor& post_norm,
    double eps, const torch::Tensor& qkv_w, int64_t qkv_features, const torch::Tensor& o_w,
    int64_t o_features, const torch::Tensor& gate_up_w, int64_t gate_up_features,
    const torch::Tensor& down_w, int64_t down_features, bool layer_amx,
    const torch::Tensor& cos_table, const torch::Tensor& sin_table,
    const torch::Tensor& positions, int64_t num_q, int64_t num_kv, torch::Tensor cache_k,
    torch::Tensor cache_v, const torch::Tensor& slots, const torch::Tensor& base,
    const torch::Tensor& mask, bool append_eye, double scale, const torch::Tensor& vocab_w,
    int64_t vocab_features, bool vocab_amx, int64_t k, const std::optional<torch::Tensor>& d2t,
    const std::optional<torch::Tensor>& logit_rows) {
  TORCH_CHECK(tokens.dim() == 2 && features.dim() == 3 &&
                  features.size(0) == tokens.size(0) && features.size(1) == tokens.size(1) &&
                  positions.sizes() == tokens.sizes() && mask.dim() == 3 &&
                  mask.size(0) == tokens.size(0) && mask.size(1) == tokens.size(1),
              "head_step: tokens [B, N], features [B, N, H], positions [B, N] and mask "
              "[B, N, T] disagree");
  const std::vector<c10::IValue> no_inputs;
  const int64_t B = tokens.size(0), N = tokens.size(1);
  auto linear = [&](const torch::Tensor& in, const torch::Tensor& w, int64_t features_out,
                    bool amx) {
    if (amx) {
      RECORD_FUNCTION("eagle2_cpu::linear_amx", no_inputs);
      return linear_amx(in, w, features_out);
    }
    RECORD_FUNCTION("eagle2_cpu::linear_fma", no_inputs);
    return linear_fma(in, w, features_out);
  };
  const auto embeds =
      embed.index_select(0, tokens.reshape(-1)).view({B, N, embed.size(1)}).to(at::kBFloat16);
  const auto h = linear(at::cat({embeds, features.to(at::kBFloat16)}, -1), fc_w, fc_features,
                        fc_amx);
  const auto tree_mask =
      append_eye ? at::cat({mask, at::eye(N, mask.options()).expand({B, N, N})}, 2) : mask;
  const int64_t T = tree_mask.size(2);
  const auto write_pos = base.unsqueeze(1) + at::arange(T - N, T, base.options());
  const auto flat = positions.reshape(-1);
  const int64_t dh = cos_table.size(1);
  const auto cos = cos_table.index_select(0, flat).view({B, N, dh});
  const auto sin = sin_table.index_select(0, flat).view({B, N, dh});
  auto out = decoder_layer(h, at::empty({0}, post_norm.options()), post_norm, eps, qkv_w, qkv_features, o_w,
                           o_features, gate_up_w, gate_up_features, down_w, down_features, cos,
                           sin, num_q, num_kv, cache_k, cache_v, slots, write_pos, base,
                           tree_mask, scale, std::nullopt, std::nullopt, layer_amx,
                           std::nullopt);
  torch::Tensor values, indices;
  if (k > 0) {
    // logit_rows [B]: the log-probs of one output a request (its last new position) -> [B, k]
    const auto rows = logit_rows.has_value()
                          ? out.index({at::arange(B, logit_rows->options()), *logit_rows})
                          : out;
    const auto logits = linear(rows, vocab_w, vocab_features, vocab_amx).to(at::kFloat);
    {
      RECORD_FUNCTION("eagle2_cpu::top_log_probs", no_inputs);
      std::tie(values, indices) = top_log_probs(logits, k);
    }
    if (d2t.has_value() && d2t->numel())
      indices = d2t->index_select(0, indices.reshape(-1)).view(indices.sizes());
  }
  return {out, tree_mask, values, indices};
}

// Registered as torch operators (torch.ops.eagle2_cpu.*): the profiler sees them by name.
TORCH_LIBRARY(eagle2_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("qkv_rope_write(Tensor qkv, Tensor cos, Tensor sin, int num_q, int num_kv, "
        "Tensor(a!) cache_k, Tensor(b!) cache_v, Tensor slots, Tensor write_pos, "
        "Tensor? block_tables=None) -> Tensor");
  m.def("attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor slots, Tensor base, "
        "Tensor tree_mask, float scale, Tensor(c!)? key_blocks=None, "
        "Tensor(d!)? key_blocks_valid=None, Tensor? block_tables=None) -> Tensor");
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, int chunk_features) -> Tensor");
  m.def("linear_fma(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("pack_argmax(Tensor weight) -> (Tensor, Tensor)");
  m.def("greedy_argmax(Tensor x, Tensor q, Tensor stats, Tensor weight, int out_features, "
        "Tensor? q_tiles=None, int tile_rows=1) -> Tensor");
  m.def("pack_argmax_tiles(Tensor q) -> Tensor");
  m.def("decoder_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_w, "
        "int qkv_features, Tensor o_w, int o_features, Tensor gate_up_w, int gate_up_features, "
        "Tensor down_w, int down_features, Tensor cos, Tensor sin, int num_q, int num_kv, "
        "Tensor(a!) cache_k, Tensor(b!) cache_v, Tensor slots, Tensor write_pos, Tensor base, "
        "Tensor tree_mask, float scale, Tensor(c!)? key_blocks=None, "
        "Tensor(d!)? key_blocks_valid=None, bool amx=False, Tensor? block_tables=None) "
        "-> Tensor");
  m.def("decoder_layers(Tensor x, Tensor[] input_norms, Tensor[] post_norms, float eps, "
        "Tensor[] qkv_w, int qkv_features, Tensor[] o_w, int o_features, Tensor[] gate_up_w, "
        "int gate_up_features, Tensor[] down_w, int down_features, Tensor cos, Tensor sin, "
        "int num_q, int num_kv, Tensor(a!) cache_k, Tensor(b!) cache_v, int first_layer, "
        "Tensor slots, Tensor write_pos, Tensor base, Tensor tree_mask, float scale, "
        "Tensor(c!)? key_blocks=None, Tensor(d!)? key_blocks_valid=None, bool amx=False, "
        "Tensor? block_tables=None) -> Tensor");
  m.def("top_log_probs(Tensor logits, int k) -> (Tensor, Tensor)");
  m.def("head_step(Tensor tokens, Tensor features, Tensor embed, Tensor fc_w, int fc_features, "
        "bool fc_amx, Tensor post_norm, float eps, Tensor qkv_w, int qkv_features, Tensor o_w, "
        "int o_features, Tensor gate_up_w, int gate_up_features, Tensor down_w, "
        "int down_features, bool layer_amx, Tensor cos_table, Tensor sin_table, "
        "Tensor positions, int num_q, int num_kv, Tensor(a!) cache_k, Tensor(b!) cache_v, "
        "Tensor slots, Tensor base, Tensor mask, bool append_eye, float scale, Tensor vocab_w, "
        "int vocab_features, bool vocab_amx, int k, Tensor? d2t=None, Tensor? logit_rows=None) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("linear_amx(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("amx_ready() -> bool");
  m.def("isa() -> str");
}

TORCH_LIBRARY_IMPL(eagle2_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qkv_rope_write", &qkv_rope_write);
  m.impl("attention", &attention);
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
  m.impl("linear_fma", &linear_fma);
  m.impl("silu_mul", &silu_mul);
  m.impl("top_log_probs", &top_log_probs);
  m.impl("linear_amx", &linear_amx);
  m.impl("pack_argmax", &pack_argmax);
  m.impl("pack_argmax_tiles", &pack_argmax_tiles);
  m.impl("greedy_argmax", &greedy_argmax);
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("head_step", &head_step);
}

TORCH_LIBRARY_IMPL(eagle2_cpu, CatchAll, m) {
  m.impl("isa", &isa);
  m.impl("amx_ready", &amx_ready);
}
