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
// head (grouped-query attention), so each K/V block is read once for all of them. A decode (one
// token) runs attention_decode.h's AVX-512 kernel where the build and head size have one, else
// attend_token here (portable vector code); several tokens, or one prompt token, run attend_tile
// (attention_tile.h's products, whose rounding per row does not depend on the tile) over the
// request's context packed once per step: each (request, kv head, chunk of keys) is copied from
// the cache into the products' layouts by one task, before the tiles, whatever the number of
// tiles that read it (a 2,000-token prompt has 32 tiles per kv head, which each copied their
// chunks before). Over the blocks each keeps a flash-style online softmax (running max and sum
// per row) in float32; a row sees keys at positions <= its own (the causal offset of a request
// with a cached prefix: position = num_computed + index in the request's new tokens), and with a
// sliding window only the last `sliding_window` of them. A decode of a context longer than
// kSplitTokens is split over it into spans of kSplitTokens (items the threads share), merged
// afterwards by their running max and sum: always, whatever the thread count and the step's
// other requests, so that a decode's bits depend on its own context only (greedy speculative
// decoding, which verifies its drafts as one-token decodes, then gives the tokens of plain
// decoding on any number of threads). On one thread, where it buys nothing, it costs a decode of
// a longer context some of its attention time (benchmarks/attention_bench.py --layers 30, bf16:
// 16 x 512 and 1 x 512 about 8%, 1 x 1024 11%; contexts up to 256 are not split).
// Threads: the packing tasks, then the items (largest first, so that long items do not leave
// threads idle), are claimed one at a time by the calling thread and the work pool's helpers
// (work_pool.h, the matmul kernels' pool, attached by kiln_x86.attention), or by torch's threads
// where the pool has none; a small step (kMinParallelCost) runs on the calling thread. Which
// thread runs an item never changes its bits.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "attention_common.h"
#include "attention_decode.h"
#include "attention_tile.h"
#include "bf16.h"
#include "work_pool.h"

namespace {

constexpr int64_t kQueryTile = 64;     // query tokens per prefill item
constexpr int64_t kChunkKeys = 256;    // keys per product in a prefill item
constexpr int64_t kSplitTokens = 256;  // context per item when a decode is split
// Steps smaller than this (query rows x keys: about 25 us on one thread) run on the calling
// thread: under load, an OpenMP fork/join has cost far more than such a step.
constexpr int64_t kMinParallelCost = 4096;

using kiln_x86::round_to;
using kiln_x86::to_float;
using namespace kiln_x86::attention;  // NOLINT: this file's own helpers

// Keys per chunk of a prefill tile: whole blocks, about kChunkKeys.
inline int64_t chunk_keys(const Problem& p) {
  return std::max<int64_t>(1, kChunkKeys / p.block_size) * p.block_size;
}

// Online softmax step of one row over scores s[0, n) (already scaled, -inf where masked, at
// least one finite): updates the running max and sum, rescales the row's output, leaves the
// probabilities in s.
// max(s[0, n)), 16 lanes at a time.
inline float row_max(const float* s, int64_t n) {
  const int64_t n16 = n / 16 * 16;
  vf16 max16 = splat(kNegInf);
  for (int64_t j = 0; j < n16; j += 16) {
    const vf16 x = load16(s + j);
    max16 = x > max16 ? x : max16;
  }
  float block_max = kNegInf;
  for (int i = 0; i < 16; ++i) block_max = std::max(block_max, max16[i]);
  for (int64_t j = n16; j < n; ++j) block_max = std::max(block_max, s[j]);
  return block_max;
}

inline void softmax_step(float* s, int64_t n, float* m, float* l, float* orow, int64_t d) {
  const int64_t n16 = n / 16 * 16;
  const float new_max = std::max(*m, row_max(s, n));
  const float correction = exp_nonpositive(*m - new_max);  // 0 on the row's first keys
  vf16 sum16 = {};
  for (int64_t j = 0; j < n16; j += 16) {
    const vf16 e = exp_nonpositive16(load16(s + j) - new_max);
    std::memcpy(s + j, &e, sizeof(e));
    sum16 += e;
  }
  float sum = 0.0f;
  for (int i = 0; i < 16; ++i) sum += sum16[i];
  for (int64_t j = n16; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - new_max);
    sum += s[j];
  }
  *m = new_max;
  *l = *l * correction + sum;
  for (int64_t i = 0; i < d; ++i) orow[i] *= correction;
}

#if defined(KILN_X86_BF16_TILE)
// softmax_step for a tile whose output product takes bf16 probabilities: n a multiple of 16; each
// probability is rounded to bf16 (nearest even), the sum adds the rounded values, and the row's
// n bf16 values are left at the start of its scores (s as uint16_t: value j at element j).
inline void softmax_step_bf16(float* s, int64_t n, float* m, float* l, float* orow, int64_t d) {
  const float new_max = std::max(*m, row_max(s, n));
  const float correction = exp_nonpositive(*m - new_max);  // 0 on the row's first keys
  vf16 sum16 = {};
  auto* p16 = reinterpret_cast<uint16_t*>(s);
  for (int64_t j = 0; j < n; j += 16) {
    const vf16 e = exp_nonpositive16(load16(s + j) - new_max);
    __m512 ev;
    std::memcpy(&ev, &e, sizeof(ev));
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(ev);
    // Written behind the reads: bytes [2 j, 2 j + 32) of s were read at element j / 2.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + j), b);
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    vf16 r;
    std::memcpy(&r, &back, sizeof(r));
    sum16 += r;
  }
  float sum = 0.0f;
  for (int i = 0; i < 16; ++i) sum += sum16[i];
  *m = new_max;
  *l = *l * correction + sum;
  for (int64_t i = 0; i < d; ++i) orow[i] *= correction;
}
#endif

// One query token (rows: its `group` heads), head_size a multiple of 16: keys and values are
// read from the cache blocks in place, 16 lanes at a time, widened to float32 in registers.
template <typename T>
void attend_token(const Problem& p, const WorkItem& it, const T* query, const T* key_cache,
                  const T* value_cache, Scratch& sc) {
  const int64_t d = p.head_size, bs = p.block_size, group = p.group, lanes = d / 16;
  const int64_t pos0 = p.seq_lens[it.req] - (p.query_start_loc[it.req + 1] - it.token_begin);
  const int32_t* table = p.block_table + it.req * p.table_stride;
  float* q = sc.q;
  float* o = sc.o;
  float* s = sc.s;  // [group, block_size]
  for (int64_t g = 0; g < group; ++g) {
    const T* src = query + it.token_begin * p.q_stride_token +
                   (it.kv_head * group + g) * p.q_stride_head;
    for (int64_t i = 0; i < d; ++i) q[g * d + i] = to_float(src[i]) * p.scale;
  }
  std::fill(o, o + group * d, 0.0f);
  std::fill(sc.m, sc.m + group, kNegInf);
  std::fill(sc.l, sc.l + group, 0.0f);
  const KeyRange range = key_range(p, it, pos0, 1);
  for (int64_t block_start = range.lo / bs * bs; block_start < range.hi; block_start += bs) {
    const int64_t block = table[block_start / bs];
    const int64_t j0 = std::max(range.lo, block_start) - block_start;
    const int64_t j1 = std::min(range.hi, block_start + bs) - block_start;
    const T* kb = key_cache + block * p.kv_stride_block + it.kv_head * p.kv_stride_head;
    const T* vb = value_cache + block * p.kv_stride_block + it.kv_head * p.kv_stride_head;
    // Blocks lie anywhere in the cache, where hardware prefetchers cannot follow: ask for the
    // next block's rows of this kv head while this one is computed.
    if (block_start + bs < range.hi) {
      const int64_t next = table[block_start / bs + 1];
      const char* nk = reinterpret_cast<const char*>(key_cache + next * p.kv_stride_block +
                                                     it.kv_head * p.kv_stride_head);
      const char* nv = reinterpret_cast<const char*>(value_cache + next * p.kv_stride_block +
                                                     it.kv_head * p.kv_stride_head);
      const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
      const int64_t slot_bytes = p.kv_stride_slot * static_cast<int64_t>(sizeof(T));
      for (int64_t j = 0; j < bs; ++j) {
        for (int64_t b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(nk + j * slot_bytes + b);
          __builtin_prefetch(nv + j * slot_bytes + b);
        }
      }
    }
    // The block's rows widened to float32 once, for all the group's heads.
    float* kf = sc.k;  // [j1 - j0, d]
    float* vf = sc.v;
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t c = 0; c < lanes; ++c) {
        const vf16 kv = load16(kb + j * p.kv_stride_slot + c * 16);
        const vf16 vv = load16(vb + j * p.kv_stride_slot + c * 16);
        std::memcpy(kf + (j - j0) * d + c * 16, &kv, sizeof(kv));
        std::memcpy(vf + (j - j0) * d + c * 16, &vv, sizeof(vv));
      }
    }
    // Scores 16 keys at a time: a vector of partial products per key, then one add tree.
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      for (int64_t jb = j0; jb < j1; jb += 16) {
        const int64_t nj = std::min<int64_t>(16, j1 - jb);
        vf16 acc[16] = {};
        for (int64_t j = 0; j < nj; ++j) {
          const float* kr = kf + (jb + j - j0) * d;
          for (int64_t c = 0; c < lanes; ++c) acc[j] += load16(qg + c * 16) * load16(kr + c * 16);
        }
        const vf16 sums = sum_lanes16(acc);
        for (int64_t j = 0; j < nj; ++j) s[g * bs + jb + j - j0] = sums[j];
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      softmax_step(s + g * bs, j1 - j0, &sc.m[g], &sc.l[g], o + g * d, d);
    }
    for (int64_t j = j0; j < j1; ++j) {
      const float* vr = vf + (j - j0) * d;
      for (int64_t c = 0; c < lanes; ++c) {
        const vf16 vv = load16(vr + c * 16);
        for (int64_t g = 0; g < group; ++g) {
          vf16 acc = load16(o + g * d + c * 16) + s[g * bs + j - j0] * vv;
          std::memcpy(o + g * d + c * 16, &acc, sizeof(acc));
        }
      }
    }
  }
}

// A request's context for the tiles of one kv head, packed by pack_context: chunks of
// chunk_keys(p) keys (ld with padding) from chunk `first_chunk`, `words` floats each.
struct Context {
  const float* base;
  int64_t first_chunk, words, ld;
};

// A tile of query tokens (rows: token-major, then the group's heads) over its request's packed
// context, a chunk of chunk_keys(p) keys at a time (attention_tile.h's products). Chunks start at
// multiples of the chunk size, whatever the tile, and the products pad them to kKeyPad keys, so
// each row sees the same chunks, of the same width, in every tile it may fall in (the online
// softmax's sums, and so its bits, depend on both); padding keys, like keys past a row's
// position, weigh exactly 0.
template <typename T>
void attend_tile(const Problem& p, const WorkItem& it, const T* query, const Context& ctx,
                 Scratch& sc) {
  using Operands = TileOperands<T>;
  const int64_t d = p.head_size, dp = round_up(d, 16), group = p.group;
  const int64_t num_tokens = it.token_end - it.token_begin;
  const int64_t rows = num_tokens * group, rows_pad = round_up(rows, kTileRows);
  const int64_t pos0 = p.seq_lens[it.req] - (p.query_start_loc[it.req + 1] - it.token_begin);
  const int64_t chunk = chunk_keys(p);
  float* q = sc.q;  // [rows_pad, dp]
  float* s = sc.s;  // [rows_pad, n_pad]
  float* o = sc.o;  // [rows_pad, dp]
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const T* src = query + (it.token_begin + t) * p.q_stride_token +
                     (it.kv_head * group + g) * p.q_stride_head;
      Operands::put_query(src, d, dp, t * group + g, q);
    }
  }
  Operands::pad_queries(rows, rows_pad, d, dp, q);
  std::fill(o, o + rows_pad * dp, 0.0f);
  std::fill(sc.m, sc.m + rows, kNegInf);
  std::fill(sc.l, sc.l + rows, 0.0f);
  const KeyRange range = key_range(p, it, pos0, num_tokens);
  for (int64_t c0 = range.lo / chunk * chunk; c0 < range.hi; c0 += chunk) {
    const int64_t c1 = std::min(range.hi, c0 + chunk);  // keys [c0, c1)
    const int64_t n_pad = round_up(c1 - c0, kKeyPad);
    const float* packed = ctx.base + (c0 / chunk - ctx.first_chunk) * ctx.words;
    Operands::scores(q, rows_pad, d, dp, packed, ctx.ld, n_pad, s);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = pos0 + r / group;
      int64_t lo = std::max(range.lo, c0);
      if (p.sliding_window > 0) lo = std::max<int64_t>(lo, pos - p.sliding_window + 1);
      const int64_t hi = std::min(c1, pos + 1);
      float* sr = s + r * n_pad;
      if (lo >= hi) {  // no key of this chunk for this row
        std::fill(sr, sr + n_pad, 0.0f);
        continue;
      }
      // Masked: the chunk's keys before the row's first visible one and after its own position.
      std::fill(sr, sr + (lo - c0), kNegInf);
      for (int64_t j = lo - c0; j < hi - c0; ++j) sr[j] *= p.scale;
      std::fill(sr + (hi - c0), sr + n_pad, kNegInf);
#if defined(KILN_X86_BF16_TILE)
      if constexpr (Operands::kPairProbs) {
        softmax_step_bf16(sr, n_pad, &sc.m[r], &sc.l[r], o + r * dp, dp);
        continue;
      }
#endif
      softmax_step(sr, n_pad, &sc.m[r], &sc.l[r], o + r * dp, dp);
    }
    Operands::output(s, rows_pad, n_pad, packed, d, dp, ctx.ld, o);
  }
  if (dp != d) {  // rows back to write_rows' stride d (in place: each moves down)
    for (int64_t r = 1; r < rows; ++r) std::memmove(o + r * d, o + r * dp, d * sizeof(float));
  }
}

// A request's new rows are prompt rows: tiled even when there is one (a prefix-cache hit or a
// chunk that leaves one prompt token), so they get the bits the whole prompt's prefill gave them.
inline bool is_prompt(const Problem& p, int64_t req) {
  return p.prompt_reqs != nullptr && p.prompt_reqs[req] != 0;
}

inline bool uses_tile(const Problem& p, const WorkItem& it) {
  return it.token_end - it.token_begin > 1 || p.head_size % 16 != 0 || is_prompt(p, it.req);
}

template <typename T>
void attend(const Problem& p, const WorkItem& it, const T* query, const T* key_cache,
            const T* value_cache, const Context& ctx, Scratch& sc) {
  if (!uses_tile(p, it)) {
    if (!decode_avx512<T>(p, it, query, key_cache, value_cache, sc)) {
      attend_token<T>(p, it, query, key_cache, value_cache, sc);
    }
  } else {
    attend_tile<T>(p, it, query, ctx, sc);
  }
}

template <typename T>
void write_rows(const Problem& p, const WorkItem& it, const Scratch& sc, T* out) {
  const int64_t d = p.head_size, group = p.group;
  for (int64_t t = 0; t < it.token_end - it.token_begin; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      const float inv = 1.0f / sc.l[r];  // l > 0: a row always sees its own position
      const float* orow = sc.o + r * d;
      T* dst = out + (it.token_begin + t) * p.out_stride_token +
               (it.kv_head * group + g) * p.out_stride_head;
      for (int64_t i = 0; i < d; ++i) dst[i] = round_to<T>(orow[i] * inv);
    }
  }
}

// The step's items, largest first; `num_partials` counts the split decodes' parts, `parallel`
// says whether the step is worth torch's threads (else it runs on the calling thread). Whether and
// where a decode is split depends on its own context length only, never on the step's other
// requests or the thread count: the split changes the rounding.
std::vector<WorkItem> plan(const Problem& p, int64_t num_reqs, int64_t num_threads,
                           int64_t* num_partials, bool* parallel) {
  int64_t total_cost = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t query_len = p.query_start_loc[r + 1] - p.query_start_loc[r];
    total_cost += query_len * p.seq_lens[r] * p.num_heads;
  }
  *parallel = num_threads > 1 && total_cost >= kMinParallelCost;
  const int64_t span = std::max<int64_t>(1, kSplitTokens / p.block_size) * p.block_size;
  std::vector<WorkItem> items;
  int32_t partial = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int32_t start = p.query_start_loc[r], end = p.query_start_loc[r + 1];
    const int32_t seq_len = p.seq_lens[r];
    if (end <= start) continue;
    const int32_t num_computed = seq_len - (end - start);
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      if (end - start == 1 && seq_len > span && !is_prompt(p, r)) {
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

// The running thread's buffers (torch's threads, the work pool's helpers, the caller), grown to
// the largest item each has met.
inline Scratch& thread_scratch() {
  thread_local Scratch sc;
  return sc;
}

// fn(i, scratch) once for every i in [0, n), in no given order: shared with the work pool's
// helpers where it has any (one item at a time, from one counter), else over torch's threads,
// else (or when `parallel` is false) on the calling thread. Each thread's scratch is reserved
// for rows x dp query rows and `keys` keys first.
template <typename Fn>
void for_each_item(int64_t n, bool parallel, int64_t rows, int64_t dp, int64_t keys,
                   const Fn& fn) {
  auto scratch = [&]() -> Scratch& {
    Scratch& sc = thread_scratch();
    sc.reserve(rows, dp, keys);
    return sc;
  };
  kiln_x86::WorkPool& pool = kiln_x86::WorkPool::instance();
  if (parallel && n > 1 && pool.helpers() > 0) {
    pool.run(n, [&](int64_t i) { fn(i, scratch()); });
  } else if (parallel && n > 1 && at::get_num_threads() > 1) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Scratch& sc = scratch();
      for (int64_t i = next++; i < n; i = next++) fn(i, sc);
    });
  } else {
    Scratch& sc = scratch();
    for (int64_t i = 0; i < n; ++i) fn(i, sc);
  }
}

// The packed contexts of the requests that tiles read (attention_tile.h's chunk layouts), one
// per (request, kv head): chunks from the first one a tile of the request may see to the one
// holding its last key, each packed once, however many tiles read it.
struct PackedContexts {
  std::vector<int64_t> first, count, offset;  // per request: first chunk, chunks, words offset
  int64_t chunk = 0, ld = 0, words = 0;
  float* data = nullptr;

  Context at(int64_t req, int64_t kv_head) const {
    return {data + offset[req] + kv_head * count[req] * words, first[req], words, ld};
  }
};

// The step's packed contexts, filled (packing shared with the pool's helpers or torch's threads
// where `parallel`), into a buffer kept for the next call.
template <typename T>
PackedContexts pack_contexts(const Problem& p, int64_t num_reqs, const std::vector<WorkItem>& items,
                             const T* key_cache, const T* value_cache, bool parallel) {
  using Operands = TileOperands<T>;
  const int64_t d = p.head_size, dp = round_up(d, 16), bs = p.block_size;
  PackedContexts pc;
  pc.chunk = chunk_keys(p);
  pc.ld = round_up(pc.chunk, kKeyPad);
  pc.words = Operands::chunk_words(d, dp, pc.ld);
  pc.first.assign(num_reqs, 0);
  pc.count.assign(num_reqs, 0);
  pc.offset.assign(num_reqs, 0);
  for (const WorkItem& it : items) {
    if (!uses_tile(p, it) || pc.count[it.req] > 0) continue;
    const int64_t seq_len = p.seq_lens[it.req];
    const int64_t computed = seq_len - (p.query_start_loc[it.req + 1] - p.query_start_loc[it.req]);
    const int64_t lo =
        p.sliding_window > 0 ? std::max<int64_t>(0, computed - p.sliding_window + 1) : 0;
    pc.first[it.req] = lo / pc.chunk;
    pc.count[it.req] = (seq_len + pc.chunk - 1) / pc.chunk - pc.first[it.req];
  }
  std::vector<std::array<int64_t, 3>> tasks;  // (request, kv head, chunk)
  int64_t total = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    pc.offset[r] = total;
    total += pc.count[r] * p.num_kv_heads * pc.words;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t c = 0; c < pc.count[r]; ++c) tasks.push_back({r, h, pc.first[r] + c});
    }
  }
  if (total == 0) return pc;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < total) buffer.resize(total);
  pc.data = buffer.data();
  for_each_item(static_cast<int64_t>(tasks.size()), parallel, 1, dp, 1, [&](int64_t i, Scratch&) {
    const auto [r, h, c] = tasks[i];
    const int32_t* table = p.block_table + r * p.table_stride;
    const int64_t c0 = c * pc.chunk;
    const int64_t n = std::min<int64_t>(p.seq_lens[r], c0 + pc.chunk) - c0;
    auto offset = [&](int64_t j) {
      const int64_t pos = c0 + j;
      return table[pos / bs] * p.kv_stride_block + (pos % bs) * p.kv_stride_slot +
             h * p.kv_stride_head;
    };
    float* dst = pc.data + pc.offset[r] + (h * pc.count[r] + c - pc.first[r]) * pc.words;
    Operands::pack_chunk(key_cache, value_cache, offset, n, d, dp, pc.ld, dst);
  });
  return pc;
}

template <typename T>
void run(const Problem& p, int64_t num_reqs, const T* query, const T* key_cache,
         const T* value_cache, T* out) {
  const int64_t workers = 1 + std::max<int64_t>(kiln_x86::WorkPool::instance().helpers(),
                                                at::get_num_threads() - 1);
  int64_t num_partials = 0;
  bool parallel = false;
  const std::vector<WorkItem> items = plan(p, num_reqs, workers, &num_partials, &parallel);
  const int64_t d = p.head_size, group = p.group;
  // Split decodes' parts: unnormalized output [group, d], then max and sum [group] each.
  const int64_t partial_size = group * (d + 2);
  std::vector<float> partials(num_partials * partial_size);
  const PackedContexts contexts =
      pack_contexts(p, num_reqs, items, key_cache, value_cache, parallel);

  // Each thread's buffers fit the step's largest item: decode-only steps need little.
  int64_t max_tokens = 1;
  int64_t keys = p.block_size;
  for (const WorkItem& it : items) {
    max_tokens = std::max<int64_t>(max_tokens, it.token_end - it.token_begin);
    if (uses_tile(p, it)) keys = std::max(keys, contexts.ld);
  }
  // Tiles pad their rows and head size (attention_tile.h's layouts).
  const int64_t rows = round_up(max_tokens * group, kTileRows), dp = round_up(d, 16);
  for_each_item(static_cast<int64_t>(items.size()), parallel, rows, dp, keys,
                [&](int64_t i, Scratch& sc) {
                  const WorkItem& it = items[i];
                  const Context ctx =
                      uses_tile(p, it) ? contexts.at(it.req, it.kv_head) : Context{};
                  attend<T>(p, it, query, key_cache, value_cache, ctx, sc);
                  if (it.partial < 0) {
                    write_rows<T>(p, it, sc, out);
                    return;
                  }
                  float* dst = partials.data() + it.partial * partial_size;
                  std::copy(sc.o, sc.o + group * d, dst);
                  std::copy(sc.m, sc.m + group, dst + group * d);
                  std::copy(sc.l, sc.l + group, dst + group * d + group);
                });
  if (num_partials == 0) return;

  // Merge each split decode's parts: weights exp(max_part - max_all), float32 throughout.
  std::vector<WorkItem> heads;  // one per split (request, kv head), with its first partial
  for (const WorkItem& it : items) {
    if (it.partial >= 0 && it.ctx_begin == 0) heads.push_back(it);
  }
  const int64_t span = std::max<int64_t>(1, kSplitTokens / p.block_size) * p.block_size;
  {  // a few heads' rows: on this thread
    Scratch sc(group, d, 1);
    for (size_t hi = 0; hi < heads.size(); ++hi) {
      const WorkItem& it = heads[hi];
      const int64_t num_parts = (p.seq_lens[it.req] + span - 1) / span;
      for (int64_t g = 0; g < group; ++g) {
        float max_all = kNegInf;
        for (int64_t k = 0; k < num_parts; ++k) {
          const float* part = partials.data() + (it.partial + k) * partial_size;
          max_all = std::max(max_all, part[group * d + g]);
        }
        float sum = 0.0f;
        float* og = sc.o + g * d;
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
  }
}

// out[t, h, :] for every token of a request (rows of padding are left alone): attention of
// query [T, H, D] over the paged caches [num_blocks, block_size, Hkv, D] (float32 or bfloat16,
// query's dtype), per block_table [B, max_blocks] int32, query_start_loc [B + 1] int32 and
// seq_lens [B] int32 (context after the step, the new tokens included, already in the cache);
// prompt_reqs [B] int32 (1: the request's new rows are prompt rows) or empty (one new row is a
// decode).
void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t sliding_window, const at::Tensor& prompt_reqs) {
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
  if (prompt_reqs.numel() > 0) {
    TORCH_CHECK(prompt_reqs.scalar_type() == at::kInt && prompt_reqs.is_contiguous() &&
                    prompt_reqs.size(0) == seq_lens.size(0),
                "prompt_reqs must be contiguous int32 with one entry per request, or empty");
    p.prompt_reqs = prompt_reqs.data_ptr<int32_t>();
  }
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

// Writes the step's keys and values [>= n, Hkv, D] (tokens may be strided, each token dense) into the
// caches at slot_mapping [n] int64 (slot = block * block_size + offset), then runs
// paged_attention: the cache update and the attention of one layer in one call.
void paged_attention_update(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_table, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                            const at::Tensor& prompt_reqs) {
  const int64_t n = slot_mapping.size(0);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t row = key_cache.size(2) * key_cache.size(3);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) >= n && t->size(1) * t->size(2) == row &&
                    t->stride(2) == 1 && t->stride(1) == t->size(2),
                "key and value must be [>= n, Hkv, D] with each token dense");
  }
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type(),
              "key and value must have the caches' dtype");
  TORCH_CHECK(key_cache.stride(2) == key_cache.size(3) && key_cache.stride(3) == 1 &&
                  key_cache.strides() == value_cache.strides(),
              "each cache slot must be dense [Hkv, D]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t bytes = row * static_cast<int64_t>(key.element_size());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t es = key.element_size();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < num_blocks * block_size, "slot ", slot,
                " is outside the cache");
    const int64_t offset = ((slot / block_size) * key_cache.stride(0) +
                        (slot % block_size) * key_cache.stride(1)) * es;
    std::memcpy(kc + offset, kp + t * key.stride(0) * es, bytes);
    std::memcpy(vc + offset, vp + t * value.stride(0) * es, bytes);
  }
  paged_attention(out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                  scale, sliding_window, prompt_reqs);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "paged attention over the KV cache in place (decodes, prefills, cached prefixes)");
  kiln_x86::def_attach_pool(m);
  m.def("paged_attention_update", &paged_attention_update,
        "write the step's keys and values into the caches, then paged_attention");
}
