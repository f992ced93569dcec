// The paged KV cache as the CPU ops take it: (2, num_blocks, block_size, num_kv_heads, row) of fp32, bf16
// or int8 (--kv-cache-dtype int8: row = head_dim values then their fp32 scale, rowops::KvInt8).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "rowops.h"

namespace servelab {

// Calls f(T{}) with the cache's element type: float, c10::BFloat16 or rowops::KvInt8.
template <typename F>
void dispatch_kv(at::ScalarType type, F&& f) {
  if (type == at::kBFloat16) {
    f(c10::BFloat16{});
  } else if (type == at::kFloat) {
    f(float{});
  } else if (type == at::kChar) {
    f(rowops::KvInt8{});
  } else {
    TORCH_CHECK(false, "the KV cache must be float32, bfloat16 or int8");
  }
}

// head_dim of a cache: its row length less an int8 row's scale.
inline int64_t kv_head_dim(const at::Tensor& kv_cache) {
  return kv_cache.size(4) - (kv_cache.scalar_type() == at::kChar ? rowops::KvRow<rowops::KvInt8>::extra : 0);
}

template <typename T>
T* kv_data(const at::Tensor& kv_cache) {
  return reinterpret_cast<T*>(kv_cache.data_ptr());
}

}  // namespace servelab
