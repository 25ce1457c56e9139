// kiln-x86 paged attention: every request of a step (decodes, prefills, later chunks of a prompt,
// prefix-cache hits) attends over its context where it lies in the paged KV cache, block by block
// through the block table, with no gather copy.
//
// Cache layout (Kiln's CPU layout): key and value caches [num_blocks, block_size, num_kv_heads,
// head_size]. The caller has already written the step's new keys and values into the cache, so a
// request's whole context, prefix and new tokens alike, is read from there.
//
// Work is split into items of (request, kv head, tile of up to kQueryTile query tokens, span of
// context). An item's rows are the tile's tokens times the `group` query heads that share the kv
// head (grouped-query attention), so each K/V block is read, and converted to float32, once for
// all of them. Over the blocks it keeps a flash-style online softmax (running max and sum per row)
// in float32; a row sees keys at positions <= its own (the causal offset of a request with a cached
// prefix: position = num_computed + index in the request's new tokens), and with a sliding window
// only the last `sliding_window` of them. Decodes of long contexts with too few (request, kv head)
// pairs to keep the threads busy are split over the context into spans of kSplitTokens, merged
// afterwards by their running max and sum. Items are handed to torch's threads one at a time,
// largest first, so that long items do not leave threads idle.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;     // query tokens per prefill item
constexpr int64_t kSplitTokens = 256;  // context per item when a decode is split
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float v) { return v; }

inline float to_float(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T round_to(float v);

template <>
inline float round_to<float>(float v) {
  return v;
}

// Round to nearest even, as c10 does (NaN kept a quiet NaN).
template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (v != v) ? 0x7fc00000u : u + 0x7fffu + ((u >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(rounded >> 16), c10::BFloat16::from_bits());
}

// exp(x) for x <= 0 (scores minus their running max), branch-free so that loops of it vectorize:
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error below
// 2e-7, about float32's rounding), times 2^n built in the exponent bits. Below -87 it returns 0,
// as it does for -inf (a masked score).
inline float exp_nonpositive(float x) {
  const bool underflow = !(x > -87.0f);
  x = underflow ? 0.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split: exact n * hi
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

struct WorkItem {
  int32_t req;
  int32_t kv_head;
  int32_t token_begin;  // the tile's query tokens, rows of `query` [token_begin, token_end)
  int32_t token_end;
  int32_t ctx_begin;    // the keys this item covers, positions [ctx_begin, ctx_end)
  int32_t ctx_end;
  int32_t partial;      // slot in the partial results of a split decode, or -1: write `out`
  int64_t cost;
};

struct Problem {
  const int32_t* query_start_loc;  // [B + 1]
  const int32_t* seq_lens;         // [B]
  const int32_t* block_table;      // [B, table_stride]
  int64_t table_stride;
  int64_t num_heads, num_kv_heads, group, head_size, block_size;
  int64_t q_stride_token, q_stride_head;      // query [T, H, D]
  int64_t kv_stride_block, kv_stride_slot, kv_stride_head;  // caches [nb, bs, Hkv, D]
  int64_t out_stride_token, out_stride_head;  // out [T, H, D]
  float scale;
  int64_t sliding_window;  // <= 0: none
};

// Per-thread buffers, float32.
struct Scratch {
  std::vector<float> q, o, s, kt, v, m, l;
  Scratch(int64_t rows, int64_t d, int64_t bs)
      : q(rows * d), o(rows * d), s(rows * bs), kt(d * bs), v(bs * d), m(rows), l(rows) {}
};

// Runs one item; leaves each row's unnormalized output, running max and sum in `sc`.
template <typename T>
void attend(const Problem& p, const WorkItem& it, const T* query, const T* key_cache,
            const T* value_cache, Scratch& sc) {
  const int64_t d = p.head_size, bs = p.block_size, group = p.group;
  const int64_t num_tokens = it.token_end - it.token_begin;
  const int64_t rows = num_tokens * group;
  const int64_t query_len = p.query_start_loc[it.req + 1] - p.query_start_loc[it.req];
  const int64_t num_computed = p.seq_lens[it.req] - query_len;
  // Context position of the tile's first token.
  const int64_t pos0 = num_computed + (it.token_begin - p.query_start_loc[it.req]);
  const int32_t* table = p.block_table + it.req * p.table_stride;

  float* q = sc.q.data();
  float* o = sc.o.data();
  float* s = sc.s.data();
  float* kt = sc.kt.data();
  float* v = sc.v.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const T* src = query + (it.token_begin + t) * p.q_stride_token +
                     (it.kv_head * group + g) * p.q_stride_head;
      float* dst = q + (t * group + g) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]) * p.scale;
    }
  }
  std::fill(o, o + rows * d, 0.0f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);

  // Keys any row of the tile may see.
  const int64_t last_pos = pos0 + num_tokens - 1;
  int64_t lo = it.ctx_begin;
  if (p.sliding_window > 0) lo = std::max<int64_t>(lo, pos0 - p.sliding_window + 1);
  const int64_t hi = std::min<int64_t>(it.ctx_end, last_pos + 1);  // exclusive
  for (int64_t block_start = lo / bs * bs; block_start < hi; block_start += bs) {
    const int64_t block = table[block_start / bs];
    const int64_t k_begin = std::max(lo, block_start) - block_start;  // valid slots in the block
    const int64_t k_end = std::min(hi, block_start + bs) - block_start;
    const T* kb = key_cache + block * p.kv_stride_block + it.kv_head * p.kv_stride_head;
    const T* vb = value_cache + block * p.kv_stride_block + it.kv_head * p.kv_stride_head;
    // K transposed to [d, bs] so that scores vectorize over the block's keys; V as [bs, d].
    // Slots outside [k_begin, k_end) may hold anything (never written): zeros, never read as NaN.
    for (int64_t j = 0; j < bs; ++j) {
      const bool valid = j >= k_begin && j < k_end;
      const T* kr = kb + j * p.kv_stride_slot;
      const T* vr = vb + j * p.kv_stride_slot;
      for (int64_t i = 0; i < d; ++i) {
        kt[i * bs + j] = valid ? to_float(kr[i]) : 0.0f;
        v[j * d + i] = valid ? to_float(vr[i]) : 0.0f;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = pos0 + r / group;
      // This row's keys in the block: [row_lo, row_hi).
      const int64_t row_hi = std::min<int64_t>(k_end, pos + 1 - block_start);
      int64_t row_lo = k_begin;
      if (p.sliding_window > 0) {
        row_lo = std::max<int64_t>(row_lo, pos - p.sliding_window + 1 - block_start);
      }
      if (row_lo >= row_hi) continue;
      float* sr = s + r * bs;
      const float* qr = q + r * d;
      std::fill(sr, sr + bs, 0.0f);
      for (int64_t i = 0; i < d; ++i) {
        const float qi = qr[i];
        const float* ki = kt + i * bs;
        for (int64_t j = 0; j < bs; ++j) sr[j] += qi * ki[j];
      }
      float block_max = kNegInf;
      for (int64_t j = 0; j < bs; ++j) {
        sr[j] = (j >= row_lo && j < row_hi) ? sr[j] : kNegInf;
        block_max = std::max(block_max, sr[j]);
      }
      const float new_max = std::max(m[r], block_max);
      const float correction = exp_nonpositive(m[r] - new_max);  // 0 on the first block
      float block_sum = 0.0f;
      for (int64_t j = 0; j < bs; ++j) {
        sr[j] = exp_nonpositive(sr[j] - new_max);
        block_sum += sr[j];
      }
      m[r] = new_max;
      l[r] = l[r] * correction + block_sum;
      float* orow = o + r * d;
      for (int64_t i = 0; i < d; ++i) orow[i] *= correction;
      for (int64_t j = row_lo; j < row_hi; ++j) {
        const float pj = sr[j];
        const float* vj = v + j * d;
        for (int64_t i = 0; i < d; ++i) orow[i] += pj * vj[i];
      }
    }
  }
}

template <typename T>
void write_rows(const Problem& p, const WorkItem& it, const Scratch& sc, T* out) {
  const int64_t d = p.head_size, group = p.group;
  for (int64_t t = 0; t < it.token_end - it.token_begin; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      const float inv = 1.0f / sc.l[r];  // l > 0: a row always sees its own position
      const float* orow = sc.o.data() + r * d;
      T* dst = out + (it.token_begin + t) * p.out_stride_token +
               (it.kv_head * group + g) * p.out_stride_head;
      for (int64_t i = 0; i < d; ++i) dst[i] = round_to<T>(orow[i] * inv);
    }
  }
}

// The step's items, largest first; `num_partials` counts the split decodes' parts.
std::vector<WorkItem> plan(const Problem& p, int64_t num_reqs, int64_t num_threads,
                           int64_t* num_partials) {
  int64_t num_decodes = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    num_decodes += (p.query_start_loc[r + 1] - p.query_start_loc[r]) == 1;
  }
  // Split decodes over their context when (request, kv head) pairs are too few for the threads.
  const bool split = num_decodes * p.num_kv_heads < 4 * num_threads;
  const int64_t span = std::max<int64_t>(1, kSplitTokens / p.block_size) * p.block_size;
  std::vector<WorkItem> items;
  int32_t partial = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int32_t start = p.query_start_loc[r], end = p.query_start_loc[r + 1];
    const int32_t seq_len = p.seq_lens[r];
    if (end <= start) continue;
    const int32_t num_computed = seq_len - (end - start);
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      if (end - start == 1 && split && seq_len > span) {
        for (int32_t c = 0; c < seq_len; c += span) {
          const int32_t c_end = std::min<int32_t>(seq_len, c + span);
          items.push_back({static_cast<int32_t>(r), static_cast<int32_t>(h), start, end, c, c_end,
                           partial++, static_cast<int64_t>(c_end - c) * p.group});
        }
        continue;
      }
      for (int32_t t = start; t < end; t += kQueryTile) {
        const int32_t t_end = std::min<int32_t>(end, t + kQueryTile);
        const int64_t keys = num_computed + (t_end - start);
        items.push_back({static_cast<int32_t>(r), static_cast<int32_t>(h), t, t_end, 0, seq_len,
                         -1, keys * (t_end - t) * p.group});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  *num_partials = partial;
  return items;
}

template <typename T>
void run(const Problem& p, int64_t num_reqs, const T* query, const T* key_cache,
         const T* value_cache, T* out) {
  const int64_t num_threads = at::get_num_threads();
  int64_t num_partials = 0;
  const std::vector<WorkItem> items = plan(p, num_reqs, num_threads, &num_partials);
  const int64_t d = p.head_size, group = p.group;
  // Split decodes' parts: unnormalized output [group, d], then max and sum [group] each.
  const int64_t partial_size = group * (d + 2);
  std::vector<float> partials(num_partials * partial_size);
  std::vector<const WorkItem*> firsts;  // each split decode's first part (parts are contiguous)

  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto worker = [&](int64_t, int64_t) {
    Scratch sc(kQueryTile * group, d, p.block_size);
    for (int64_t i = next++; i < num_items; i = next++) {
      const WorkItem& it = items[i];
      attend<T>(p, it, query, key_cache, value_cache, sc);
      if (it.partial < 0) {
        write_rows<T>(p, it, sc, out);
        continue;
      }
      float* dst = partials.data() + it.partial * partial_size;
      std::copy(sc.o.begin(), sc.o.begin() + group * d, dst);
      std::copy(sc.m.begin(), sc.m.begin() + group, dst + group * d);
      std::copy(sc.l.begin(), sc.l.begin() + group, dst + group * d + group);
    }
  };
  if (num_items > 1 && num_threads > 1) {
    at::parallel_for(0, num_threads, 1, worker);
  } else {
    worker(0, 1);
  }
  if (num_partials == 0) return;

  // Merge each split decode's parts: weights exp(max_part - max_all), float32 throughout.
  std::vector<WorkItem> heads;  // one per split (request, kv head), with its first partial
  for (const WorkItem& it : items) {
    if (it.partial >= 0 && it.ctx_begin == 0) heads.push_back(it);
  }
  const int64_t span = std::max<int64_t>(1, kSplitTokens / p.block_size) * p.block_size;
  at::parallel_for(0, static_cast<int64_t>(heads.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch sc(group, d, 1);
    for (int64_t hi = begin; hi < end; ++hi) {
      const WorkItem& it = heads[hi];
      const int64_t num_parts = (p.seq_lens[it.req] + span - 1) / span;
      for (int64_t g = 0; g < group; ++g) {
        float max_all = kNegInf;
        for (int64_t k = 0; k < num_parts; ++k) {
          const float* part = partials.data() + (it.partial + k) * partial_size;
          max_all = std::max(max_all, part[group * d + g]);
        }
        float sum = 0.0f;
        float* og = sc.o.data() + g * d;
        std::fill(og, og + d, 0.0f);
        for (int64_t k = 0; k < num_parts; ++k) {
          const float* part = partials.data() + (it.partial + k) * partial_size;
          const float part_sum = part[group * d + group + g];
          if (part_sum == 0.0f) continue;  // every key of the part masked (sliding window)
          const float w = exp_nonpositive(part[group * d + g] - max_all);
          sum += part_sum * w;
          for (int64_t i = 0; i < d; ++i) og[i] += part[g * d + i] * w;
        }
        sc.l[g] = sum;
      }
      write_rows<T>(p, it, sc, out);
    }
  });
}

// out[t, h, :] for every token of a request (rows of padding are left alone): attention of
// query [T, H, D] over the paged caches [num_blocks, block_size, Hkv, D] (float32 or bfloat16,
// query's dtype), per block_table [B, max_blocks] int32, query_start_loc [B + 1] int32 and
// seq_lens [B] int32 (context after the step, the new tokens included, already in the cache).
void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4,
              "query and out must be [T, H, D], the caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key and value caches must have one shape and layout");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(),
              "query, out and the caches must share a dtype");
  for (const auto* t : {&query, &out, &key_cache, &value_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->stride(-1) == 1, "tensors must be CPU, last dim dense");
  }
  for (const auto* t : {&block_table, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "block_table, query_start_loc and seq_lens must be contiguous int32");
  }
  Problem p;
  p.num_heads = query.size(1);
  p.head_size = query.size(2);
  p.num_kv_heads = key_cache.size(2);
  p.block_size = key_cache.size(1);
  TORCH_CHECK(p.num_heads % p.num_kv_heads == 0 && key_cache.size(3) == p.head_size,
              "num_heads must be a multiple of the caches' kv heads, head sizes must agree");
  p.group = p.num_heads / p.num_kv_heads;
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.table_stride = block_table.size(1);
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.kv_stride_block = key_cache.stride(0);
  p.kv_stride_slot = key_cache.stride(1);
  p.kv_stride_head = key_cache.stride(2);
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.scale = static_cast<float>(scale);
  p.sliding_window = sliding_window;
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_table.size(0) >= num_reqs,
              "query_start_loc must have num_reqs + 1 entries, block_table a row per request");

  if (query.scalar_type() == at::kFloat) {
    run<float>(p, num_reqs, query.data_ptr<float>(), key_cache.data_ptr<float>(),
               value_cache.data_ptr<float>(), out.data_ptr<float>());
  } else if (query.scalar_type() == at::kBFloat16) {
    using bf16 = c10::BFloat16;
    run<bf16>(p, num_reqs, query.data_ptr<bf16>(), key_cache.data_ptr<bf16>(),
              value_cache.data_ptr<bf16>(), out.data_ptr<bf16>());
  } else {
    TORCH_CHECK(false, "kiln_x86 paged_attention: dtype ", query.scalar_type(),
                " is not supported (float32, bfloat16)");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "paged attention over the KV cache in place (decodes, prefills, cached prefixes)");
}
