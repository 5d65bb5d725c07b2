// The n-gram store's chains for a batch of requests in one call (eagle2/ngram.py,
// `NgramStore.propose_many`; docs/draft-tree.md "The n-gram store").
//
// The same walk as `NgramStore.propose`, bit for bit: per chain token, the keys of the
// contexts of order 1..max_order ending at the chain's end (one 64-bit hash over the tokens
// read backwards, `_context_keys`), the longest one found in the sorted keys, its token and
// rate; the value is the product of the rates so far, in the same order, in doubles, and the
// chain stops where the next token would be worth less than min_value. In Python each token
// cost a numpy search and ~10 us of interpreter around it: inside the engine at batch 8 ~0.5
// ms a step. A key is found through a radix index (`starts`: where the keys whose top bits
// are b begin), two cache misses rather than a binary search's ~20: between two calls the
// target's forward streams its weights through the caches, and a batch of 8 binary-searching
// cold keys cost ~180 us.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr uint64_t kMult = 0x9E3779B97F4A7C15ULL;  // ngram._MULT
constexpr uint64_t kSeed = 0x2545F4914F6CDD1DULL;  // ngram._SEED
constexpr int64_t kMaxOrder = 16;  // the longest context a store may key (it keys MAX_ORDER)

// keys [K] int64 (the store's uint64 keys, same bits, sorted as unsigned), starts [2^bits + 1]
// int64 (the first key whose top `bits` bits are >= b), next [K] int32, rates [K] float64
// (each key's rate: rates[cells]); contexts [B, C] int64, each row the last
// tokens of a request, -1 before a history shorter than C. -> (tokens [B, depth] int64, -1
// past a chain's end; values [B, depth] float64, 0 there).
std::tuple<at::Tensor, at::Tensor> ngram_chains(const at::Tensor& keys, const at::Tensor& starts,
                                                const at::Tensor& next, const at::Tensor& rates,
                                                const at::Tensor& contexts, int64_t depth,
                                                double min_value, int64_t max_order) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.is_contiguous(),
              "ngram_chains: keys must be a contiguous 1-d int64 tensor");
  const int64_t num_starts = starts.numel();
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.is_contiguous() && num_starts >= 3 &&
                  ((num_starts - 1) & (num_starts - 2)) == 0,
              "ngram_chains: starts must be a contiguous int64 tensor of 2^bits + 1 offsets");
  const int shift = 64 - __builtin_ctzll(static_cast<uint64_t>(num_starts - 1));
  TORCH_CHECK(next.scalar_type() == at::kInt && next.is_contiguous() &&
                  next.numel() == keys.numel(),
              "ngram_chains: next must be a contiguous int32 tensor, one per key");
  TORCH_CHECK(rates.scalar_type() == at::kDouble && rates.is_contiguous() &&
                  rates.numel() == keys.numel(),
              "ngram_chains: rates must be a contiguous float64 tensor, one per key");
  TORCH_CHECK(contexts.dim() == 2 && contexts.scalar_type() == at::kLong,
              "ngram_chains: contexts must be a 2-d int64 tensor");
  TORCH_CHECK(depth >= 0 && max_order >= 1 && max_order <= kMaxOrder,
              "ngram_chains: depth >= 0 and 1 <= max_order <= 16");
  const auto ctx = contexts.contiguous();
  const int64_t num_b = ctx.size(0), width = ctx.size(1);
  auto out_tokens = at::full({num_b, depth}, -1, at::kLong);
  auto out_values = at::zeros({num_b, depth}, at::kDouble);
  const auto* key = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  const int64_t* start = starts.data_ptr<int64_t>();
  const int32_t* nxt = next.data_ptr<int32_t>();
  const double* rate = rates.data_ptr<double>();
  const int64_t* c = ctx.data_ptr<int64_t>();
  int64_t* tok_out = out_tokens.data_ptr<int64_t>();
  double* val_out = out_values.data_ptr<double>();
  std::vector<int64_t> seq;
  for (int64_t b = 0; b < num_b; ++b) {
    seq.clear();
    for (int64_t j = 0; j < width; ++j)
      if (c[b * width + j] >= 0) seq.push_back(c[b * width + j]);
    double value = 1.0;
    for (int64_t d = 0; d < depth; ++d) {
      // the longest known context ending the sequence: the keys of orders 1 .. max_order
      // (each hash extends the shorter one's), then searched from the longest down, so a
      // known long context costs one bucket's cache misses, not one for every order
      const int64_t orders = std::min<int64_t>(max_order, static_cast<int64_t>(seq.size()));
      uint64_t hashes[kMaxOrder];
      uint64_t h = kSeed;
      for (int64_t o = 1; o <= orders; ++o) {
        h = (h ^ static_cast<uint64_t>(seq[seq.size() - o] + 1)) * kMult;
        hashes[o - 1] = h;
      }
      int64_t found = -1;
      for (int64_t o = orders; o >= 1 && found < 0; --o) {
        const uint64_t hk = hashes[o - 1], bucket = hk >> shift;
        for (int64_t i = start[bucket]; i < start[bucket + 1]; ++i)
          if (key[i] == hk) found = i;
      }
      if (found < 0 || value * rate[found] < min_value) break;
      value *= rate[found];
      tok_out[b * depth + d] = nxt[found];
      val_out[b * depth + d] = value;
      seq.push_back(nxt[found]);
    }
  }
  return {out_tokens, out_values};
}

}  // namespace

TORCH_LIBRARY(eagle2_ngram, m) {
  m.def("ngram_chains(Tensor keys, Tensor starts, Tensor next, Tensor rates, Tensor contexts, "
        "int depth, float min_value, int max_order) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(eagle2_ngram, CPU, m) { m.impl("ngram_chains", &ngram_chains); }
