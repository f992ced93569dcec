// The whole forward pass of a decode step for one sequence, in one call and one parallel region.
//
// At batch 1 a step is ~270 MB of bf16 weights streamed once; the op-by-op path adds ~10 Python
// calls, torch dispatches and OpenMP fork/joins per layer, a few ms per step on two cores. Here
// each thread keeps its own copy of the residual stream and of the normed activations (recomputing
// a 576-float norm is cheaper than a barrier), takes a contiguous slab of every weight matrix, and
// meets the other threads at a barrier only where a matmul needs a vector the others computed:
// five barriers per layer. The matrices are streamed from a packed copy (gemv.h: ~15% faster than
// the row-major originals, which the batched paths keep using), so bf16 weights take twice their
// size in memory while the runner exists.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gemv.h"
#include "kv_cache.h"
#include "ops.h"
#include "q4_packed.h"
#include "quant_blocks.h"
#include "rowops.h"

namespace servelab {
namespace {

const uint16_t* bf16_bits(const at::Tensor& w) {
  return reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
}

void check_weight(const at::Tensor& w, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2 && w.size(0) == rows &&
                  w.size(1) == cols, "DecodeRunner: ", name, " must be contiguous bf16 (", rows, ", ", cols, ")");
}

// A packed copy of w (gemv.h), which the runner streams instead of w.
at::Tensor packed(const at::Tensor& w) {
  TORCH_CHECK(w.size(0) % gemv::PACK == 0, "DecodeRunner: matrix rows must be a multiple of ", gemv::PACK);
  auto out = at::empty_like(w);
  gemv::pack(bf16_bits(w), w.size(0), w.size(1), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// A matrix as the runner streams it: bf16 packed (gemv.h), Q4_0 / Q4_1 repacked for inputs rounded to
// 8 bits (q4_packed.h; its type becomes q4_packed::TYPE), or GGUF blocks as stored.
at::Tensor prepared(const at::Tensor& w, int64_t& type, int64_t rows, int64_t cols, const char* name,
                    bool int8_inputs) {
  if (type == DecodeRunner::BF16) {
    check_weight(w, rows, cols, name);
    return packed(w);
  }
  TORCH_CHECK(quant::supported(type) && cols % quant::block_values(type) == 0 && w.scalar_type() == at::kByte &&
                  w.is_contiguous() && w.dim() == 2 && w.size(0) == rows && w.size(1) == quant::row_bytes(type, cols),
              "DecodeRunner: ", name, " must be bf16 or contiguous GGUF blocks (", rows, ", row bytes) of a supported type");
  if (!int8_inputs || !q4_packed::suits(type, cols)) return w;
  auto out = at::empty({rows, q4_packed::row_bytes(cols)}, w.options());
  q4_packed::pack(type, w.data_ptr<uint8_t>(), rows, cols, out.data_ptr<uint8_t>());
  type = q4_packed::TYPE;
  return out;
}

// One thread's GEMV input, prepared once for every matrix it multiplies: its even/odd split (bf16), its
// sub-block sums (GGUF), or its values rounded to 8 bits (GGUF with int8 inputs).
struct GemvInput {
  std::vector<float> even, odd, sums, d, s;
  std::vector<int8_t> q;
  const float* x = nullptr;
  int64_t K = 0;
  explicit GemvInput(int64_t widest)
      : even(widest / 2), odd(widest / 2), sums(widest / quant::SUB), d(widest / quant::SUB),
        s(widest / quant::SUB), q(widest) {}

  // x (K values) for matrices of `type`.
  void load(const float* x_in, int64_t K_in, int64_t type, bool int8_inputs) {
    x = x_in, K = K_in;
    if (type == DecodeRunner::BF16)
      gemv::split_even_odd(x, K, even.data(), odd.data());
    else if (int8_inputs)
      quant::quantize_input(x, K, q.data(), d.data(), s.data());
    else
      quant::subblock_sums(x, K, sums.data());
  }
};

// y[n] = w[n] . x for rows [begin, end) (multiples of gemv::PACK) of a prepared matrix, x loaded in `in`
// for its type.
void gemv_rows(const at::Tensor& w, int64_t type, const GemvInput& in, float* y, int64_t begin, int64_t end,
               bool int8_inputs) {
  if (type == DecodeRunner::BF16) {
    gemv::packed_rows(in.even.data(), in.odd.data(), bf16_bits(w), in.K, y, begin, end);
    return;
  }
  float* ys[1] = {y};
  if (int8_inputs) {
    const quant::Q8Input xs[1] = {{in.q.data(), in.d.data(), in.s.data()}};
    if (type == q4_packed::TYPE)
      q4_packed::rows(w.data_ptr<uint8_t>(), in.K, xs[0], y, begin, end);
    else
      quant::int8_rows<1>(type, w.data_ptr<uint8_t>(), in.K, xs, ys, begin, end);
    return;
  }
  const float* xs[1] = {in.x};
  const float* ss[1] = {in.sums.data()};
  quant::rows<1>(type, w.data_ptr<uint8_t>(), in.K, xs, ss, ys, begin, end);
}

// in.load(x, ...) then gemv_rows: a matrix whose input no other matrix shares.
void multiply(const at::Tensor& w, int64_t type, const float* x, int64_t K, float* y, int64_t begin, int64_t end,
              GemvInput& in, bool int8_inputs) {
  in.load(x, K, type, int8_inputs);
  gemv_rows(w, type, in, y, begin, end, int8_inputs);
}

void check_vector(const at::Tensor& v, int64_t n, const char* name) {
  TORCH_CHECK(v.scalar_type() == at::kFloat && v.is_contiguous() && v.numel() == n,
              "DecodeRunner: ", name, " must be contiguous fp32 of ", n, " elements");
}

// residual += x; out = rms_norm(residual) * w.
void add_and_norm(float* residual, const float* x, const float* w, double eps, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(residual + i, _mm256_add_ps(_mm256_loadu_ps(residual + i), _mm256_loadu_ps(x + i)));
  rowops::norm_row(residual, w, out, n, eps);
}

}  // namespace

DecodeRunner::DecodeRunner(at::Tensor embed, int64_t embed_type, at::Tensor lm_head, int64_t lm_head_type,
                           at::Tensor final_norm, at::Tensor cos, at::Tensor sin, int64_t num_heads,
                           int64_t num_kv_heads, double eps, bool int8_inputs)
    : embed_(std::move(embed)), final_norm_(std::move(final_norm)), cos_(std::move(cos)), sin_(std::move(sin)),
      embed_type_(embed_type), lm_head_type_(lm_head_type), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      eps_(eps), int8_inputs_(int8_inputs) {
  hidden_ = final_norm_.numel();
  head_dim_ = cos_.size(1);
  if (embed_type_ == BF16) {
    TORCH_CHECK(embed_.scalar_type() == at::kBFloat16 && embed_.is_contiguous() && embed_.size(1) == hidden_,
                "DecodeRunner: bf16 embeddings");
  } else {
    embed_ = prepared(embed_, embed_type_, embed_.size(0), hidden_, "embed_tokens", false);  // read as stored
  }
  TORCH_CHECK(hidden_ % 16 == 0 && head_dim_ % 8 == 0 && num_heads % num_kv_heads == 0, "DecodeRunner: shapes");
  lm_head_ = prepared(lm_head, lm_head_type_, lm_head.size(0), hidden_, "lm_head", int8_inputs_);
  check_vector(final_norm_, hidden_, "final_norm");
  TORCH_CHECK(cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat && cos_.is_contiguous() &&
                  sin_.is_contiguous() && sin_.sizes() == cos_.sizes(), "DecodeRunner: fp32 cos, sin");
}

void DecodeRunner::add_layer(at::Tensor input_norm, at::Tensor qkv, c10::optional<at::Tensor> qkv_bias,
                             at::Tensor o, at::Tensor post_norm, at::Tensor gate_up, at::Tensor down,
                             std::vector<int64_t> types) {
  TORCH_CHECK(types.size() == 4, "DecodeRunner: one weight type for each of qkv, o, gate_up, down");
  const int64_t q_size = num_heads_ * head_dim_, qkv_rows = q_size + 2 * num_kv_heads_ * head_dim_;
  const int64_t inter = gate_up.size(0) / 2;
  TORCH_CHECK(inter % 16 == 0, "DecodeRunner: intermediate size must be a multiple of 16");
  check_vector(input_norm, hidden_, "input_norm");
  check_vector(post_norm, hidden_, "post_attention_norm");
  if (qkv_bias.has_value()) check_vector(*qkv_bias, qkv_rows, "qkv_bias");
  if (!layers_.empty()) TORCH_CHECK(inter == layers_[0].gate_up.size(0) / 2, "DecodeRunner: layers differ");
  TORCH_CHECK(inter % gemv::PACK == 0, "DecodeRunner: intermediate size must be a multiple of ", gemv::PACK);
  int64_t qkv_type = types[0], o_type = types[1], gate_up_type = types[2], down_type = types[3];
  auto qkv_w = prepared(qkv, qkv_type, qkv_rows, hidden_, "qkv_proj", int8_inputs_);
  auto o_w = prepared(o, o_type, hidden_, q_size, "o_proj", int8_inputs_);
  auto gate_up_w = prepared(gate_up, gate_up_type, 2 * inter, hidden_, "gate_up_proj", int8_inputs_);
  auto down_w = prepared(down, down_type, hidden_, inter, "down_proj", int8_inputs_);
  layers_.push_back({std::move(input_norm), std::move(qkv_w), qkv_bias.value_or(at::Tensor()), std::move(o_w),
                     std::move(post_norm), std::move(gate_up_w), std::move(down_w), qkv_type, o_type, gate_up_type,
                     down_type});
}

at::Tensor DecodeRunner::forward(int64_t token, int64_t position, int64_t slot, const at::Tensor& block_table,
                                 const std::vector<at::Tensor>& kv_caches) {
  TORCH_CHECK(!layers_.empty() && kv_caches.size() == layers_.size(), "DecodeRunner: one KV cache per layer");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous(), "DecodeRunner: int64 block table");
  TORCH_CHECK(0 <= token && token < embed_.size(0) && 0 <= position && position < cos_.size(0),
              "DecodeRunner: token or position out of range");
  const at::ScalarType kv_type = kv_caches[0].scalar_type();
  for (const auto& c : kv_caches)
    TORCH_CHECK((kv_type == at::kBFloat16 || kv_type == at::kChar) && c.scalar_type() == kv_type && c.is_contiguous() &&
                    c.dim() == 5 && c.size(3) == num_kv_heads_ && kv_head_dim(c) == head_dim_,
                "DecodeRunner: bf16 or int8 KV caches (2, blocks, block_size, kv_heads, row), all alike");
  const int64_t H = hidden_, hd = head_dim_, group = num_heads_ / num_kv_heads_;
  const int64_t q_size = num_heads_ * hd, kv_size = num_kv_heads_ * hd, qkv_rows = q_size + 2 * kv_size;
  const int64_t inter = layers_[0].gate_up.size(0) / 2, block_size = kv_caches[0].size(2);
  const int64_t context = position + 1;
  TORCH_CHECK(block_table.numel() * block_size >= context, "DecodeRunner: block table too short");
  const int64_t token_stride = num_kv_heads_ * kv_caches[0].size(4);  // a cached token's row, in elements
  TORCH_CHECK(slot >= 0 && slot < kv_caches[0].numel() / 2 / token_stride, "DecodeRunner: slot out of range");
  const int64_t* table = block_table.data_ptr<int64_t>();
  const float* cos = cos_.data_ptr<float>() + position * hd;
  const float* sin = sin_.data_ptr<float>() + position * hd;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));

  // Vectors every thread reads after a barrier; each thread writes its own part of them. down holds
  // the previous layer's output, added to the residual stream as the next layer starts: before the
  // first layer, the embedding (and the residual stream is zero).
  std::vector<float> qkv(qkv_rows), attn(q_size), o(H), act(inter), down(H);
  if (embed_type_ == BF16) {
    const uint16_t* embedding = bf16_bits(embed_) + token * H;
    for (int64_t i = 0; i < H; ++i) down[i] = simd::bf16_to_float(embedding[i]);
  } else {
    quant::dequantize_rows(embed_type_, embed_.data_ptr<uint8_t>(), H, token, token + 1, down.data());
  }
  auto out = at::empty({1, H}, at::kFloat);
  const int requested = at::get_num_threads();

#pragma omp parallel num_threads(requested)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t qkv_b, qkv_e, h_b, h_e, i_b, i_e;  // this thread's rows of qkv, of o and down, of gate and up
    gemv::packed_slab(qkv_rows, t, nt, qkv_b, qkv_e);
    gemv::packed_slab(H, t, nt, h_b, h_e);
    gemv::packed_slab(inter, t, nt, i_b, i_e);
    // Thread-private: the residual stream, the normed row, a GEMV input's buffers, this thread's
    // rows of up (at their row index in gate_up), attention scores.
    GemvInput in(std::max({H, q_size, inter}));
    std::vector<float> residual(H, 0.f), normed(H), up(2 * inter), scores;
    std::vector<const at::BFloat16*> kv_rows;
    std::vector<const rowops::KvInt8*> kv_rows_int8;

    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      add_and_norm(residual.data(), down.data(), layer.input_norm.data_ptr<float>(), eps_, H, normed.data());
      multiply(layer.qkv, layer.qkv_type, normed.data(), H, qkv.data(), qkv_b, qkv_e, in, int8_inputs_);
      if (layer.qkv_bias.defined()) {
        const float* b = layer.qkv_bias.data_ptr<float>();
        for (int64_t n = qkv_b; n < qkv_e; ++n) qkv[n] += b[n];
      }
#pragma omp barrier
      // Attention, one KV head per task: rotate its query group and its key, cache k and v, attend.
      auto attend = [&](auto* k_cache, auto& rows) {
        auto* v_cache = k_cache + kv_caches[l].numel() / 2;
        const int64_t head_stride = kv_caches[l].size(4);
        for (int64_t h = t; h < num_kv_heads_; h += nt) {
          float* q = qkv.data() + h * group * hd;
          float* k = qkv.data() + q_size + h * hd;
          for (int64_t g = 0; g < group; ++g) rowops::rope_rotate(q + g * hd, cos, sin, hd);
          rowops::rope_rotate(k, cos, sin, hd);
          rowops::write_cache(k_cache + slot * token_stride + h * head_stride, k, 1, hd);
          rowops::write_cache(v_cache + slot * token_stride + h * head_stride, k + kv_size, 1, hd);
          rowops::decode_attention_heads(qkv.data(), k_cache, v_cache, table, context, block_size, num_kv_heads_, hd,
                                         group, h, h + 1, scale, attn.data(), scores, rows);
        }
      };
      if (kv_type == at::kChar) {
        attend(kv_data<rowops::KvInt8>(kv_caches[l]), kv_rows_int8);
      } else {
        attend(kv_data<at::BFloat16>(kv_caches[l]), kv_rows);
      }
#pragma omp barrier
      multiply(layer.o, layer.o_type, attn.data(), q_size, o.data(), h_b, h_e, in, int8_inputs_);
#pragma omp barrier
      add_and_norm(residual.data(), o.data(), layer.post_norm.data_ptr<float>(), eps_, H, normed.data());
      // This thread's gate rows and the matching up rows, so it can apply silu(gate) * up itself.
      in.load(normed.data(), H, layer.gate_up_type, int8_inputs_);
      gemv_rows(layer.gate_up, layer.gate_up_type, in, act.data(), i_b, i_e, int8_inputs_);
      gemv_rows(layer.gate_up, layer.gate_up_type, in, up.data(), inter + i_b, inter + i_e, int8_inputs_);
      rowops::silu_mul(act.data() + i_b, up.data() + inter + i_b, i_e - i_b);
#pragma omp barrier
      multiply(layer.down, layer.down_type, act.data(), inter, down.data(), h_b, h_e, in, int8_inputs_);
#pragma omp barrier
    }
    if (t == 0) add_and_norm(residual.data(), down.data(), final_norm_.data_ptr<float>(), eps_, H, out.data_ptr<float>());
  }
  return out;
}

at::Tensor DecodeRunner::logits(const at::Tensor& hidden) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.numel() == hidden_,
              "DecodeRunner: logits of one fp32 row of hidden states");
  const int64_t vocab = lm_head_.size(0);
  auto x = hidden.contiguous();
  auto out = at::empty({1, vocab}, at::kFloat);
  const int requested = at::get_num_threads();
#pragma omp parallel num_threads(requested)
  {
    int64_t begin, end;
    GemvInput in(hidden_);
    gemv::packed_slab(vocab, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    multiply(lm_head_, lm_head_type_, x.data_ptr<float>(), hidden_, out.data_ptr<float>(), begin, end, in,
             int8_inputs_);
  }
  return out;
}

}  // namespace servelab
