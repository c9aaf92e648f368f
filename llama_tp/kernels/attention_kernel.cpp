// Attention of one new token per row to the keys and values cached so far, on CPUs with AVX-512
// or AVX2 (float_lanes.h: each extension builds it for its own registers).
//
// torch's CPU attention (flash attention, scaled_dot_product_attention) took about 190 us per
// layer for the demo model at batch 8 in a decoding step, where the cached keys and values
// (1.8 MB a layer at 150 positions) read from memory in about 70: 18% of the step. It is built
// for many queries at once; here each query is a single row, so a pass over the keys makes every
// score of the kv head's queries, a vectorized exp turns them into weights, and a pass over the
// values sums them. On AVX2 CPUs, rows at different positions (continuous batching) also made
// torch gather every row's cache into a copy and read it under a mask: 20% of a 16-row step of
// the demo model in int4 (AMD EPYC, 2 threads), where each row here reads its own cache row.
//
// A served row decodes at its prompt's length and more: a context longer than a block of the
// cache is attended in parts of a block, a task each, so that one row's 3 kv heads do not leave
// one of 2 threads waiting for the other.
//
// The keys and values are held in blocks (kv_cache.py), each row's found through its block table;
// each row reads its own positions up to its own length (rows at different positions: continuous
// batching). Query head h reads kv head h / (heads / kv heads), as scaled_dot_product_attention's
// enable_gqa has it.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "float_lanes.h"

namespace {

namespace lanes = llama_tp::lanes;
using lanes::Floats;
using lanes::kWidth;

// The `group` query heads q[group][head_dim] of one kv head attend to positions [start, end) of its
// keys and values (row stride `stride`): per query its highest score, the sum of its weights, and
// the values weighted by them (out[group][head_dim], not divided by the sum). scores: room for
// group * (end - start) floats.
void attend_part(const float* q, const float* keys, const float* values, int64_t stride, int64_t start, int64_t end,
                 int64_t group, int64_t head_dim, float* scores, float* highest, float* total, float* out) {
  const int64_t registers = head_dim / kWidth, positions = end - start;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t t = 0; t < positions; ++t) {  // each key read once for every query of the group
    const float* key = keys + (start + t) * stride;
    for (int64_t j = 0; j < group; ++j) {
      Floats dot = lanes::zeros();
      for (int64_t r = 0; r < registers; ++r)
        dot = lanes::fmadd(lanes::load(q + j * head_dim + r * kWidth), lanes::load(key + r * kWidth), dot);
      scores[j * positions + t] = lanes::sum(dot) * scale;
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* row = scores + j * positions;
    Floats most = lanes::broadcast(-INFINITY);
    for (int64_t t = 0; t < positions; t += kWidth)
      most = lanes::max(most, lanes::load_first(row + t, positions - t, -INFINITY));
    highest[j] = lanes::largest(most);
    const Floats top = lanes::broadcast(highest[j]);
    Floats sum = lanes::zeros();
    for (int64_t t = 0; t < positions; t += kWidth) {
      const Floats weights = lanes::keep_first(
          lanes::exp_of_nonpositive(lanes::sub(lanes::load_first(row + t, positions - t), top)), positions - t);
      lanes::store_first(row + t, positions - t, weights);
      sum = lanes::add(sum, weights);
    }
    total[j] = lanes::sum(sum);
    for (int64_t r = 0; r < registers; ++r) {
      Floats weighted = lanes::zeros();
      for (int64_t t = 0; t < positions; ++t)
        weighted = lanes::fmadd(lanes::broadcast(row[t]), lanes::load(values + (start + t) * stride + r * kWidth), weighted);
      lanes::store(out + j * head_dim + r * kWidth, weighted);
    }
  }
}

// The same queries' attention to its `positions` first keys and values: out[group][head_dim].
void attend(const float* q, const float* keys, const float* values, int64_t stride, int64_t positions,
            int64_t group, int64_t head_dim, float* scores, float* out) {
  thread_local std::vector<float> sums;  // each query's highest score, then each one's total weight
  sums.resize(2 * group);
  attend_part(q, keys, values, stride, 0, positions, group, head_dim, scores, sums.data(), sums.data() + group, out);
  for (int64_t j = 0; j < group; ++j) {
    const Floats inverse_total = lanes::broadcast(1.0f / sums[group + j]);
    for (int64_t i = j * head_dim; i < (j + 1) * head_dim; i += kWidth)
      lanes::store(out + i, lanes::mul(lanes::load(out + i), inverse_total));
  }
}

// The group's attention from its parts (attend_part's, `parts` of them, each group * (head_dim +
// 2) floats: highest scores, sums, then weighted values): each part's weights rescaled to the
// highest score of all.
void combine_parts(const float* partials, int64_t parts, int64_t group, int64_t head_dim, float* out) {
  const int64_t registers = head_dim / kWidth, size = group * (head_dim + 2);
  for (int64_t j = 0; j < group; ++j) {
    float highest = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) highest = std::max(highest, partials[p * size + j]);
    float total = 0.0f;
    for (int64_t r = 0; r < registers; ++r) lanes::store(out + j * head_dim + r * kWidth, lanes::zeros());
    for (int64_t p = 0; p < parts; ++p) {
      const float* part = partials + p * size;
      const float factor = std::exp(part[j] - highest);
      total += part[group + j] * factor;
      const float* weighted = part + 2 * group + j * head_dim;
      for (int64_t r = 0; r < registers; ++r) {
        float* sum = out + j * head_dim + r * kWidth;
        lanes::store(sum, lanes::fmadd(lanes::load(weighted + r * kWidth), lanes::broadcast(factor), lanes::load(sum)));
      }
    }
    const Floats inverse_total = lanes::broadcast(1.0f / total);
    for (int64_t r = 0; r < registers; ++r) {
      float* sum = out + j * head_dim + r * kWidth;
      lanes::store(sum, lanes::mul(lanes::load(sum), inverse_total));
    }
  }
}

// Each row's int64 entry in a vector of one per row (stride 0: the same for every row).
int64_t row_entry(const at::Tensor& vector, int64_t row) {
  return vector.data_ptr<int64_t>()[row * vector.stride(0)];
}

// The keys and values of every cache row, in blocks of `block` positions: pools [1, kv heads,
// blocks * block, head_dim] (contiguous), a row's positions found through its block table (row b
// of tables [batch, blocks a row]: its first block's number, its second's, ...). A block holds
// `block` consecutive positions of one row, so a part of a context that lies in one block is
// read as a plain run of positions.
struct Pool {
  float* keys;
  float* values;
  const int64_t* tables;
  int64_t table_stride, head_stride, block, head_dim;

  Pool(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_tables, int64_t block_positions)
      : keys(k_pool.data_ptr<float>()), values(v_pool.data_ptr<float>()), tables(block_tables.data_ptr<int64_t>()),
        table_stride(block_tables.stride(0)), head_stride(k_pool.size(2) * k_pool.size(3)), block(block_positions),
        head_dim(k_pool.size(3)) {}

  // Where row b's kv head kv holds position `position`, in floats from a pool's start.
  int64_t offset(int64_t b, int64_t kv, int64_t position) const {
    return kv * head_stride + (tables[b * table_stride + position / block] * block + position % block) * head_dim;
  }
};

// The pools, tables and each row's positions (or lengths, with first = 1) checked against each other.
void check_pool(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                const at::Tensor& positions, int64_t batch, int64_t block, int64_t first) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(0) == 1 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
              v_pool.is_contiguous() && k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat,
              "the pools must be contiguous fp32 [1, kv heads, positions, head_dim] alike");
  TORCH_CHECK(block > 0 && k_pool.size(2) % block == 0, "the pools must hold whole blocks of ", block, " positions");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && tables.scalar_type() == at::kLong && tables.stride(1) == 1,
              "block tables must be int64 [batch, blocks a row], each row's entries contiguous");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == batch && positions.scalar_type() == at::kLong,
              "positions (or lengths) must be int64 [batch]");
  const int64_t blocks = k_pool.size(2) / block;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t position = row_entry(positions, b);
    TORCH_CHECK(first <= position && position < tables.size(1) * block + first, "row ", b, ": position ", position,
                " outside its block table");
    for (int64_t i = 0; i <= (position - first) / block; ++i) {
      const int64_t number = tables.data_ptr<int64_t>()[b * tables.stride(0) + i];
      TORCH_CHECK(0 <= number && number < blocks, "row ", b, ": block ", number, " outside the pools");
    }
  }
}

// A token whose queries attend to its row's positions [0, context).
struct Token {
  int64_t b, context, queries;  // queries: its turned queries' offset in the query buffer and in out
};

// Every token's attention, each kv head's a task: a context of one block whole (attend), a longer
// one in parts of a block each, a task each (as flash decoding does), then combined. The parts
// follow absolute positions, so a token's result depends on its own context alone, whatever else
// the step holds; and a step of few rows with long contexts keeps every thread busy (one row of
// the demo model is 3 kv heads, for 2 threads).
void attend_tokens(const float* queries, const Pool& pool, const std::vector<Token>& tokens, int64_t kv_heads,
                   int64_t group, float* out) {
  const int64_t head_dim = pool.head_dim, block = pool.block;
  struct Part {
    int64_t token, kv, part, index;  // the part's number, and its place among the partials (-1: a whole context)
  };
  struct Parted {
    int64_t token, kv, first, parts;  // a token's kv head attended in parts: partials [first, first + parts)
  };
  std::vector<Part> tasks;
  std::vector<Parted> parted;
  int64_t partial_count = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(tokens.size()); ++i)
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      const int64_t parts = (tokens[i].context + block - 1) / block;
      if (parts == 1) {
        tasks.push_back({i, kv, 0, -1});
        continue;
      }
      parted.push_back({i, kv, partial_count, parts});
      for (int64_t part = 0; part < parts; ++part) tasks.push_back({i, kv, part, partial_count + part});
      partial_count += parts;
    }
  const int64_t partial_size = group * (head_dim + 2);
  std::vector<float> partials(partial_count * partial_size);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t finish) {
    std::vector<float> scores;
    for (int64_t i = begin; i < finish; ++i) {
      const Part& task = tasks[i];
      const Token& token = tokens[task.token];
      const int64_t first = token.queries + task.kv * group * head_dim;
      const int64_t start = task.part * block, end = std::min(token.context, start + block);
      const int64_t at = pool.offset(token.b, task.kv, start);  // the part's first position: one block holds it all
      scores.resize(group * (end - start));
      if (task.index < 0) {
        attend(queries + first, pool.keys + at, pool.values + at, head_dim, end, group, head_dim, scores.data(),
               out + first);
        continue;
      }
      float* partial = partials.data() + task.index * partial_size;
      attend_part(queries + first, pool.keys + at, pool.values + at, head_dim, 0, end - start, group, head_dim,
                  scores.data(), partial, partial + group, partial + 2 * group);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(parted.size()), 1, [&](int64_t begin, int64_t finish) {
    for (int64_t i = begin; i < finish; ++i) {
      const Parted& token = parted[i];
      combine_parts(partials.data() + token.first * partial_size, token.parts, group, head_dim,
                    out + tokens[token.token].queries + token.kv * group * head_dim);
    }
  });
}

// Queries q [batch, heads, head_dim] (contiguous) attend to the keys and values of their rows'
// positions [0, lengths[b]), found through the rows' block tables in the pools (Pool).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                            const at::Tensor& lengths, int64_t block) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous fp32 [batch, heads, head_dim]");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  check_pool(k_pool, v_pool, tables, lengths, batch, block, 1);
  const int64_t kv_heads = k_pool.size(1);
  TORCH_CHECK(k_pool.size(3) == head_dim && heads % kv_heads == 0 && head_dim % kWidth == 0, "shapes do not match");
  std::vector<Token> tokens;
  for (int64_t b = 0; b < batch; ++b) tokens.push_back({b, row_entry(lengths, b), b * heads * head_dim});
  at::Tensor out = at::empty_like(q);
  attend_tokens(q.data_ptr<float>(), Pool(k_pool, v_pool, tables, block), tokens, kv_heads, heads / kv_heads,
                out.data_ptr<float>());
  return out;
}

// One head's channel pairs (2i, 2i+1) turned by the angles whose cos and sin are turns[i]:
// apply_rotary's complex product.
void rotate(const float* x, const float* turns, int64_t head_dim, float* out) {
  for (int64_t i = 0; i < head_dim; i += 2) {
    const float cos = turns[i], sin = turns[i + 1];
    out[i] = x[i] * cos - x[i + 1] * sin;
    out[i + 1] = x[i] * sin + x[i + 1] * cos;
  }
}

// A token's key (turned) and value written at their places in the pools, and its `group` queries
// of kv head kv turned into queries; row: its wqkv product (queries, then keys, then values).
void write_token(const float* row, const float* turns, int64_t kv, int64_t heads, int64_t kv_heads, int64_t group,
                 int64_t head_dim, float* key, float* value, float* queries) {
  rotate(row + (heads + kv) * head_dim, turns, head_dim, key);
  const float* new_value = row + (heads + kv_heads + kv) * head_dim;
  std::copy(new_value, new_value + head_dim, value);
  for (int64_t j = 0; j < group; ++j) rotate(row + (kv * group + j) * head_dim, turns, head_dim, queries + j * head_dim);
}

// A step's attention in one call, as apply_rotary, KVCache.write and decode_attention do it in
// turn: row b's tokens, at positions positions[b], positions[b] + 1, ..., have their query and key
// heads turned to their positions and their keys and values written at their places in the pools
// (through the row's block table), then each token's queries attend to its row's positions [0,
// its own]. Rows may be at any positions, each its own (continuous batching) or all at one. A
// step of several tokens a row (guesses to verify, a short chunk of prompt) gives every token
// exactly the bits it would get in a step of its own.
// qkv [batch, tokens, (heads + 2 kv heads) * head_dim]: the wqkv product, queries then keys then
// values; turns [batch or 1, tokens, head_dim / 2, 2]: each token's cos and sin (one set for all
// rows); pools and tables as Pool's; positions int64 [batch]. Returns [batch, tokens, heads * head_dim].
at::Tensor decode_step_attention(const at::Tensor& qkv, const at::Tensor& turns, at::Tensor& k_pool,
                                 at::Tensor& v_pool, const at::Tensor& tables, const at::Tensor& positions,
                                 int64_t heads, int64_t block) {
  const int64_t batch = qkv.size(0), tokens = qkv.size(1);
  check_pool(k_pool, v_pool, tables, positions, batch, block, 0);
  const int64_t kv_heads = k_pool.size(1), head_dim = k_pool.size(3), width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(qkv.dim() == 3 && tokens > 0 && qkv.size(2) == width && qkv.scalar_type() == at::kFloat &&
              qkv.is_contiguous(), "qkv must be contiguous fp32 [batch, tokens, (heads + 2 kv heads) * head_dim]");
  TORCH_CHECK(turns.scalar_type() == at::kFloat && turns.is_contiguous() &&
              (turns.numel() == tokens * head_dim || turns.numel() == batch * tokens * head_dim),
              "turns must be contiguous fp32 cos and sin [batch or 1, tokens, head_dim / 2, 2]");
  TORCH_CHECK(heads % kv_heads == 0 && head_dim % kWidth == 0, "shapes do not match");
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(row_entry(positions, b) + tokens <= tables.size(1) * block, "row ", b,
                ": its last token falls outside its block table");
  const int64_t group = heads / kv_heads;
  const int64_t turns_stride = turns.numel() == tokens * head_dim ? 0 : tokens * head_dim;
  const Pool pool(k_pool, v_pool, tables, block);
  // Every token's key and value written and its queries turned first, then the attention's tasks.
  at::Tensor turned = at::empty({batch, tokens, heads, head_dim}, qkv.options());
  const float *qkv_data = qkv.data_ptr<float>(), *turn_data = turns.data_ptr<float>();
  float* query_data = turned.data_ptr<float>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t finish) {
    for (int64_t task = begin; task < finish; ++task) {
      const int64_t b = task / kv_heads, kv = task % kv_heads;
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t at = pool.offset(b, kv, row_entry(positions, b) + t);
        write_token(qkv_data + (b * tokens + t) * width, turn_data + b * turns_stride + t * head_dim, kv, heads,
                    kv_heads, group, head_dim, pool.keys + at, pool.values + at,
                    query_data + ((b * tokens + t) * heads + kv * group) * head_dim);
      }
    }
  });
  std::vector<Token> contexts;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < tokens; ++t)
      contexts.push_back({b, row_entry(positions, b) + t + 1, (b * tokens + t) * heads * head_dim});
  at::Tensor out = at::empty({batch, tokens, heads * head_dim}, qkv.options());
  attend_tokens(query_data, pool, contexts, kv_heads, group, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, int block) -> Tensor");
  m.def("decode_step_attention(Tensor qkv, Tensor turns, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor tables, "
        "Tensor positions, int heads, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_step_attention", decode_step_attention);
}
