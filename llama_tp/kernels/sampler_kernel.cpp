// Every row of a step chooses its next token in one call, on CPUs with AVX-512 or AVX2
// (float_lanes.h): sampler.py's rule, each row with its own options and its own uniform number.
//
// torch's ops take the rule a dozen passes over the step's [rows, vocab] logits, each a dispatch
// and, at 16 rows of 49,152 (3 MB), each beyond L2: 3.6-4.2 ms a step on an Intel Xeon with 2
// cores, about 9% of a 16-row int4 decoding step, and 0.84 ms (topk alone 0.3) of a one-row step
// of 7.7. Here a row is a few passes over its own 192 KB, which stay in L2: the repetition
// penalty on a copy, the best logit, then the scaled logits, their total weight and the best
// candidates in one pass; a row cut to its top k weighs its tokens in a pass of its own.
//
// The distribution is sampling.py's. A row with top_p < 1 looks at its best `candidates` tokens
// first; when their kept mass does not reach the row's cut, it looks at 8 times as many, up to the
// whole vocabulary (sorted), so the nucleus is always the one a full sort finds. Its token is
// where the running sum of the kept probabilities, best first, passes u times their total; a row
// without a top-p cut draws the same way over the vocabulary in its order.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "float_lanes.h"

namespace {

namespace lanes = llama_tp::lanes;
using lanes::Floats;
using lanes::kWidth;

constexpr float kInfinity = std::numeric_limits<float>::infinity();
// Tokens below this scaled logit have no weight: the -inf of a ban or of a cut, never a finite one.
constexpr float kLowestKept = std::numeric_limits<float>::lowest();
// Vectors of weights summed in fp32 before their sum joins the row's float64 total.
constexpr int64_t kBlock = 16;

struct RowOptions {
  float inverse_temperature;  // 0: greedy
  float top_p;                // 1 or more: no top-p cut
  float min_p;                // 0: no min-p cut
  float penalty;              // 1: no repetition penalty
  int64_t top_k;              // 0: no top-k cut (at most the candidates)
  double uniform;             // the row's draw in [0, 1)
};

struct Candidate {
  float value;
  int64_t token;
};

// Best first; among equal values, the lower id first.
bool better(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.token < b.token);
}

// One thread's sampler: its buffers stay from row to row and from step to step.
class RowSampler {
 public:
  // The token of a row of logits [vocab], with its history [length] (negative ids: padding).
  int64_t choose(const float* logits, int64_t vocab, int64_t candidates, const int64_t* history, int64_t length,
                 const RowOptions& options) {
    vocab_ = vocab;
    candidates_ = std::min(candidates, vocab);
    scaled_.resize(vocab);
    const float* row = penalised(logits, history, length, options.penalty);
    const float highest = largest(row);
    // A row with no finite best (every token banned: -inf; or NaN) has nothing to weigh: the first
    // token equal to its best, else 0. The caller knows such rows (a grammar that allows nothing)
    // and ends them; below, the best token always enters best_, which is therefore never empty.
    if (options.inverse_temperature == 0.0f || !std::isfinite(highest)) return first_equal(row, highest);
    const bool nucleus = options.top_p < 1.0f;
    float floor = std::max(kLowestKept, options.min_p > 0.0f ? std::log(options.min_p) : -kInfinity);
    // Without a top-k cut the floor is known before the pass, which then weighs the tokens too.
    const bool cut_to_k = options.top_k > 0;
    double total = scale(row, highest, options.inverse_temperature, floor, nucleus || cut_to_k, !cut_to_k, !nucleus);
    if (cut_to_k) {
      floor = std::max(floor, best_[options.top_k - 1].value);
      total = weigh(floor, !nucleus);
    }
    return nucleus ? draw_from_nucleus(floor, total, options.top_p, options.uniform)
                   : draw_in_vocabulary_order(total, options.uniform);
  }

 private:
  // The row after CTRL's repetition penalty (sampler.penalised's rule) on each token of its
  // history: a copy in scaled_, or the logits themselves where nothing changes.
  const float* penalised(const float* logits, const int64_t* history, int64_t length, float penalty) {
    if (penalty == 1.0f || length == 0) return logits;
    std::copy(logits, logits + vocab_, scaled_.data());
    for (int64_t i = 0; i < length; ++i) {
      const int64_t token = history[i];
      if (token < 0 || token >= vocab_) continue;
      const float value = logits[token];  // read from the original: a repeated token changes once
      scaled_[token] = value > 0 ? value / penalty : value * penalty;
    }
    return scaled_.data();
  }

  float largest(const float* row) const {
    Floats most = lanes::broadcast(-kInfinity);
    for (int64_t i = 0; i < vocab_; i += kWidth)
      most = lanes::max(most, lanes::load_first(row + i, vocab_ - i, -kInfinity));
    return lanes::largest(most);
  }

  int64_t first_equal(const float* row, float value) const {
    for (int64_t i = 0; i < vocab_; ++i)
      if (row[i] == value) return i;
    return 0;  // NaN logits: no token is best
  }

  // scaled_ = (row - highest) * inverse_temperature, torch's two roundings; with collect, best_ =
  // the best candidates_ of them, best first. With weigh, the total weight of the tokens at or
  // above floor is returned, and with keep_weights scaled_ holds their weights instead.
  double scale(const float* row, float highest, float inverse_temperature, float floor, bool collect, bool weigh,
               bool keep_weights) {
    const Floats top = lanes::broadcast(highest), factor = lanes::broadcast(inverse_temperature);
    const Floats kept_from = lanes::broadcast(floor);
    float threshold = -kInfinity;  // once best_ is full, a token enters it only at or above its worst
    best_.clear();
    Total total;
    for (int64_t i = 0; i < vocab_; i += kWidth) {
      const int64_t n = vocab_ - i;
      const Floats scaled = lanes::mul(lanes::sub(lanes::load_first(row + i, n, -kInfinity), top), factor);
      if (collect) {
        uint32_t entering = lanes::at_least(scaled, lanes::broadcast(threshold)) & first_lanes(n);
        if (entering) {
          alignas(64) float values[kWidth];
          lanes::store(values, scaled);
          for (; entering; entering &= entering - 1) {
            const int lane = __builtin_ctz(entering);
            best_.push_back({values[lane], i + lane});
          }
          if (static_cast<int64_t>(best_.size()) >= 2 * candidates_) threshold = keep_best();
        }
      }
      Floats stored = scaled;
      if (weigh) {
        const Floats weights = lanes::where_at_least(scaled, kept_from, lanes::exp_of_nonpositive(scaled));
        total.add(weights);
        if (keep_weights) stored = weights;
      }
      lanes::store_first(scaled_.data() + i, n, stored);
    }
    if (collect) {
      keep_best();
      std::sort(best_.begin(), best_.end(), better);
    }
    return total.value();
  }

  // best_ cut to its candidates_ best (in no order); the worst value kept.
  float keep_best() {
    if (static_cast<int64_t>(best_.size()) > candidates_) {
      std::nth_element(best_.begin(), best_.begin() + candidates_ - 1, best_.end(), better);
      best_.resize(candidates_);
    }
    return best_.back().value;
  }

  static uint32_t first_lanes(int64_t n) { return n >= kWidth ? (1u << kWidth) - 1 : (1u << n) - 1; }

  // The total weight of the scaled logits at or above floor (scaled_ turned into weights if keep_weights).
  double weigh(float floor, bool keep_weights) {
    const Floats kept_from = lanes::broadcast(floor);
    Total total;
    for (int64_t i = 0; i < vocab_; i += kWidth) {
      const int64_t n = vocab_ - i;
      const Floats scaled = lanes::load_first(scaled_.data() + i, n, -kInfinity);
      const Floats weights = lanes::where_at_least(scaled, kept_from, lanes::exp_of_nonpositive(scaled));
      total.add(weights);
      if (keep_weights) lanes::store_first(scaled_.data() + i, n, weights);
    }
    return total.value();
  }

  // Top-p among the best tokens: a token stays while the probability ranked above it is below
  // top_p. Where best_ runs out before the cut, it grows from the scaled logits (8 times as many,
  // up to all of them) and the nucleus is looked for again.
  int64_t draw_from_nucleus(float floor, double total, float top_p, double uniform) {
    for (int64_t count = candidates_;; count = std::min(vocab_, 8 * count)) {
      if (count > candidates_) collect_best(count, floor);
      kept_.clear();
      double before = 0.0;
      bool cut = false;
      for (const Candidate& candidate : best_) {
        if (candidate.value < floor || before >= top_p) {
          cut = true;
          break;
        }
        const double probability = std::exp(static_cast<double>(candidate.value)) / total;
        kept_.push_back(probability);
        before += probability;
      }
      // Held: the cut falls among best_, or best_ holds every token that could be kept.
      if (cut || static_cast<int64_t>(best_.size()) < count || count == vocab_)
        return best_[inverse_cdf(kept_, uniform)].token;
    }
  }

  // best_ = the `count` best scaled logits at or above floor, best first.
  void collect_best(int64_t count, float floor) {
    best_.clear();
    for (int64_t i = 0; i < vocab_; ++i)
      if (scaled_[i] >= floor) best_.push_back({scaled_[i], i});
    const auto end = best_.begin() + std::min(count, static_cast<int64_t>(best_.size()));
    std::partial_sort(best_.begin(), end, best_.end(), better);
    best_.erase(end, best_.end());
  }

  // The index where the running sum of weights first passes uniform times their total; the last
  // with any weight if rounding carries the target to the total (sampler.inverse_cdf's rule).
  static int64_t inverse_cdf(const std::vector<double>& weights, double uniform) {
    double total = 0.0;
    for (const double weight : weights) total += weight;
    const double target = uniform * total;
    double running = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(weights.size()); ++i) {
      if (weights[i] <= 0.0) continue;
      running += weights[i];
      last = i;
      if (running > target) return i;
    }
    return last;
  }

  // The same over the row's weights (scaled_) in vocabulary order, a vector at a time.
  int64_t draw_in_vocabulary_order(double total, double uniform) const {
    const double target = uniform * total;
    double running = 0.0;
    for (int64_t i = 0; i < vocab_; i += kWidth) {
      const int64_t n = std::min(kWidth, vocab_ - i);
      const double chunk = lanes::sum(lanes::load_first(scaled_.data() + i, n));
      if (running + chunk <= target) {
        running += chunk;
        continue;
      }
      for (int64_t j = i; j < i + n; ++j) {
        running += scaled_[j];
        if (scaled_[j] > 0.0f && running > target) return j;
      }
    }
    for (int64_t j = vocab_ - 1; j > 0; --j)  // rounding: the target was not passed
      if (scaled_[j] > 0.0f) return j;
    return 0;
  }

  // A row's total weight: fp32 lanes summed a block of vectors at a time into a float64.
  class Total {
   public:
    void add(Floats weights) {
      block_ = lanes::add(block_, weights);
      if (++vectors_ % kBlock == 0) {
        sum_ += lanes::sum(block_);
        block_ = lanes::zeros();
      }
    }
    double value() const { return sum_ + lanes::sum(block_); }

   private:
    Floats block_ = lanes::zeros();
    int64_t vectors_ = 0;
    double sum_ = 0.0;
  };

  int64_t vocab_ = 0, candidates_ = 0;
  std::vector<float> scaled_;  // the row's penalised logits, then its scaled ones or their weights
  std::vector<Candidate> best_;
  std::vector<double> kept_;  // the nucleus's probabilities, best first
};

// The next token of every row: logits [rows, vocab] fp32; history [rows, n] int64 (n may be 0);
// settings [rows, 4] fp32: 1 / temperature (0: greedy), top_p, min_p, repetition penalty; top_k
// [rows] int64 (0: none, at most candidates); uniform [rows] float64. -> [rows] int64.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& history, const at::Tensor& settings,
                       const at::Tensor& top_k, const at::Tensor& uniform, int64_t candidates) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be contiguous fp32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(history.dim() == 2 && history.size(0) == rows && history.scalar_type() == at::kLong &&
              history.is_contiguous(), "history must be contiguous int64 [rows, n]");
  TORCH_CHECK(settings.dim() == 2 && settings.size(0) == rows && settings.size(1) == 4 &&
              settings.scalar_type() == at::kFloat && settings.is_contiguous(), "settings must be fp32 [rows, 4]");
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == rows && top_k.scalar_type() == at::kLong && top_k.is_contiguous(),
              "top_k must be contiguous int64 [rows]");
  TORCH_CHECK(uniform.dim() == 1 && uniform.size(0) == rows && uniform.scalar_type() == at::kDouble &&
              uniform.is_contiguous(), "uniform must be contiguous float64 [rows]");
  TORCH_CHECK(vocab > 0 && candidates > 0, "sample_rows needs a vocabulary and candidates");
  const int64_t* top_k_data = top_k.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row)
    TORCH_CHECK(0 <= top_k_data[row] && top_k_data[row] <= std::min(candidates, vocab), "row ", row, "'s top_k ",
                top_k_data[row], " is not within its ", std::min(candidates, vocab), " candidates");
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* logit_data = logits.data_ptr<float>();
  const int64_t* history_data = history.data_ptr<int64_t>();
  const float* setting_data = settings.data_ptr<float>();
  const double* uniform_data = uniform.data_ptr<double>();
  int64_t* token_data = tokens.data_ptr<int64_t>();
  const int64_t length = history.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local RowSampler sampler;
    for (int64_t row = begin; row < end; ++row) {
      const float* s = setting_data + 4 * row;
      const RowOptions options{s[0], s[1], s[2], s[3], top_k_data[row], uniform_data[row]};
      token_data[row] = sampler.choose(logit_data + row * vocab, vocab, candidates, history_data + row * length,
                                       length, options);
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("sample_rows(Tensor logits, Tensor history, Tensor settings, Tensor top_k, Tensor uniform, int candidates) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) { m.impl("sample_rows", sample_rows); }
