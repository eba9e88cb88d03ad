// The Python module of the native CPU kernels (kernels/cpu/native.py builds it).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                           double eps);
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
            torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
bool prefill_attention_supported(int64_t head_dim);
void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start,
                       double scale, torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention over a [KVH, slots, D] cache (CPU, fp32)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU, fp32)");
  m.def("add_rms_norm", &add_rms_norm,
        "residual += x in place, then RMSNorm of the new residual (CPU, fp32)");
  m.def("rotary", &rotary, "rotary embedding of q and k in place, by position (CPU, fp32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up] rows (CPU, fp32)");
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether this build runs prefill_attention for this head_dim");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a chunk's queries at start.. over its keys, into out (CPU, fp32)");
}
