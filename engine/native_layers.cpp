// A model's whole layer stack as one call, where every linear layer multiplies a
// GGUF's own blocks: engine/fused.py's layer_program, the same kernels of
// native_cpu.cpp and native_quant.cpp called in the same order, so the same bits,
// without a return to Python between them: no interpreter, argument conversions
// or pool views between a layer's nine calls, and no GIL held. Decode 1.04x to
// 1.09x the tokens/s of the same program in Python at 1 to 32 rows
// (benchmarks/bench_cpu_kernels.py).
//
// Built once per model (engine/quant.py), it holds the packed weights, the norms
// and the rotary tables; each forward takes the step's tokens and where their
// keys and values go.

#include "native.h"

// pybind11 and its casters of tensors (not all of <torch/extension.h>: ~25 s a
// compile instead of ~65): the one source that binds, so the one that pays for it.
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

namespace {

// A packed weight and its kind's kernel.
struct BlockLinear {
  at::Tensor packed;
  at::Tensor (*kernel)(const at::Tensor&, const at::Tensor&);

  at::Tensor operator()(const at::Tensor& x) const { return kernel(x, packed); }
};

BlockLinear block_linear(const at::Tensor& packed, const std::string& kind) {
  if (kind == "Q4_1") return {packed, &q4_1_linear};
  if (kind == "Q8_0") return {packed, &q8_0_linear};
  TORCH_CHECK(false, "no kernel for ", kind, " blocks");
}

class LayerStack {
 public:
  LayerStack(const std::vector<at::Tensor>& packed, const std::vector<std::string>& kinds,
             const std::vector<at::Tensor>& norms, std::vector<at::Tensor> cos,
             std::vector<at::Tensor> sin, std::vector<int64_t> rope_of_layer, int64_t q_heads,
             double scale, double eps);

  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slots,
                     const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& block_tables, const at::Tensor& rows,
                     const at::Tensor& query_pos) const;

 private:
  struct Layer {
    BlockLinear qkv, o, gate_up, down;
    at::Tensor norm_attn_in, norm_mlp_in;
  };
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  std::vector<at::Tensor> cos_, sin_;
  std::vector<int64_t> rope_of_layer_;
  int64_t q_heads_;
  double scale_, eps_;
};

LayerStack::LayerStack(const std::vector<at::Tensor>& packed, const std::vector<std::string>& kinds,
                       const std::vector<at::Tensor>& norms, std::vector<at::Tensor> cos,
                       std::vector<at::Tensor> sin, std::vector<int64_t> rope_of_layer,
                       int64_t q_heads, double scale, double eps)
    : cos_(std::move(cos)),
      sin_(std::move(sin)),
      rope_of_layer_(std::move(rope_of_layer)),
      q_heads_(q_heads),
      scale_(scale),
      eps_(eps) {
  const size_t layers = rope_of_layer_.size();
  TORCH_CHECK(layers > 0, "a stack of no layers");
  TORCH_CHECK(packed.size() == 4 * layers && kinds.size() == packed.size(),
              "four linear layers a layer (q/k/v, o, gate/up, down), each with its kind");
  TORCH_CHECK(norms.size() == 2 * layers + 1,
              "two norms a layer (attention's input, the MLP's), then the final one");
  TORCH_CHECK(cos_.size() == sin_.size() && !cos_.empty(), "rotary tables come in pairs");
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(rope_of_layer_[i] >= 0 && rope_of_layer_[i] < static_cast<int64_t>(cos_.size()),
                "layer ", i, " names no rotary table");
    Layer layer{block_linear(packed[4 * i], kinds[4 * i]),
                block_linear(packed[4 * i + 1], kinds[4 * i + 1]),
                block_linear(packed[4 * i + 2], kinds[4 * i + 2]),
                block_linear(packed[4 * i + 3], kinds[4 * i + 3]), norms[2 * i], norms[2 * i + 1]};
    layers_.push_back(std::move(layer));
  }
  final_norm_ = norms.back();
}

// x [N, hidden]: the tokens' embeddings. Keys and values go to the pools [layers,
// blocks, block_size, Hkv, D] at slots [N]; token t attends as paged_attention's
// token t (rows, query_pos, block_tables). Returns the final norm's output [N, hidden].
at::Tensor LayerStack::forward(const at::Tensor& x, const at::Tensor& positions,
                               const at::Tensor& slots, const at::Tensor& k_pool,
                               const at::Tensor& v_pool, const at::Tensor& block_tables,
                               const at::Tensor& rows, const at::Tensor& query_pos) const {
  TORCH_CHECK(k_pool.dim() == 5 && v_pool.sizes() == k_pool.sizes() &&
                  k_pool.size(0) == static_cast<int64_t>(layers_.size()),
              "pools [layers, blocks, block_size, Hkv, D] of the stack's layers expected");
  const int64_t n = x.size(0);
  // The residual stream and the next norm's output, which feeds the next matmul.
  std::vector<at::Tensor> state = add_rms_norm(x, c10::nullopt, layers_[0].norm_attn_in, eps_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    const int64_t table = rope_of_layer_[i];
    const at::Tensor k_cache = k_pool.select(0, static_cast<int64_t>(i));
    const at::Tensor v_cache = v_pool.select(0, static_cast<int64_t>(i));
    const at::Tensor qkv = layer.qkv(state[1]);
    const at::Tensor q =
        rope_cache(qkv, positions, cos_[table], sin_[table], slots, k_cache, v_cache, q_heads_);
    const at::Tensor attended =
        paged_attention(q, k_cache, v_cache, block_tables, rows, query_pos, scale_);
    const at::Tensor out = layer.o(attended.view({n, -1}));
    state = add_rms_norm(out, state[0], layer.norm_mlp_in, eps_);
    const at::Tensor down = layer.down(silu_mul(layer.gate_up(state[1])));
    const at::Tensor& following = i + 1 < layers_.size() ? layers_[i + 1].norm_attn_in : final_norm_;
    state = add_rms_norm(down, state[0], following, eps_);
  }
  return state[1];
}

}  // namespace

// The one module of all four sources (its name is the build's, engine/native_build.py).
// The layer stack's forward and the race run without the GIL: they touch no Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm");
  m.def("rope_cache", &rope_cache, "rotary, and the KV-cache write");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("paged_attention", &paged_attention, "causal attention over the paged cache");
  m.def("q4_1_linear", &q4_1_linear, "x times a packed Q4_1 weight, transposed");
  m.def("q8_0_linear", &q8_0_linear, "x times a packed Q8_0 weight, transposed");
  m.def("pack_q4_1", &pack_q4_1, "a GGUF's Q4_1 rows in the kernel's group order");
  m.def("pack_q8_0", &pack_q8_0, "a GGUF's Q8_0 rows in the kernel's group order");
  pybind11::class_<LayerStack>(m, "LayerStack")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<std::string>&,
                          const std::vector<at::Tensor>&, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<int64_t>, int64_t, double,
                          double>(),
           pybind11::arg("packed"), pybind11::arg("kinds"), pybind11::arg("norms"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("rope_of_layer"),
           pybind11::arg("q_heads"), pybind11::arg("scale"), pybind11::arg("eps"))
      .def("forward", &LayerStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "the layers' final hidden states, keys and values stored in the pools");
  m.def("seeded_race", &seeded_race, "the seeded race of rows without filters or penalties",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
