"""A CPU decode step's whole layer stack in one call into C++ (:class:`CpuDecodeStack`).

Why: a batch-1 decode step of SmolLM2-135M on a 2-core CPU streams ~110 MB of q4 weights
(a few ms), yet the per-op path made about 55 torch or extension calls per layer, 1,650 a
token, each with its Python frame, argument parsing, tensor allocation and view
bookkeeping. Here one call runs every layer: residual add + RMSNorm, the merged q/k/v
projection, rotary and the KV write, attention over the paged cache, the output
projection, the MLP, and the final norm; the GIL is released for its length, so the
event loop's thread runs while the step computes. Buffers are allocated once per call.

Exactly what the per-op path computes: the stack calls the same C++ functions (compiled
in the same extension, :mod:`.cpu_kernels`) on the same inputs in the same order, so the
hidden states are bit-identical and greedy tokens equal (tests/test_cpu_stack.py). It
serves what that path serves with the C++ kernels on: float32 activations over q4/q8
block weights (:mod:`.cpu_quant`), ``cpu_attention_kernel`` and ``cpu_fused_ops`` both
on, no per-head q/k norm (Qwen3 keeps the per-op path); everything else keeps the
per-op path, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

SOURCE = r"""
// ---------------------------------------------------------------- the decode stack
struct StackLinear {
  at::Tensor codes, scale, minimum, bias;  // minimum: q4 only; bias: optional
  int64_t N = 0, K = 0;
  void run(const float* x, int64_t B, float* out) const {
    linear_blocks_rows(x, B, K, codes.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                       minimum.defined() ? minimum.data_ptr<float>() : nullptr,
                       bias.defined() ? bias.data_ptr<float>() : nullptr, N, out);
  }
};

struct StackLayer {
  at::Tensor norm1, norm2;
  StackLinear qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  // Per layer 18 entries: the two norm weights, then codes, scale, minimum, bias of
  // qkv, o, gate_up and down (minimum and bias may be None).
  DecodeStack(const std::vector<std::vector<c10::optional<torch::Tensor>>>& layers, torch::Tensor final_norm, double eps,
              int64_t heads, int64_t kv_heads, int64_t head_dim, double scale)
      : final_norm_(final_norm), eps_(static_cast<float>(eps)), H_(heads), KVH_(kv_heads), D_(head_dim),
        scale_(static_cast<float>(scale)) {
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 18, "a stack layer has 18 entries");
      StackLayer layer;
      layer.norm1 = float_tensor(t[0]);
      layer.norm2 = float_tensor(t[1]);
      layer.qkv = linear(t, 2);
      layer.o = linear(t, 6);
      layer.gate_up = linear(t, 10);
      layer.down = linear(t, 14);
      layers_.push_back(layer);
    }
    TORCH_CHECK(!layers_.empty(), "a stack needs a layer");
    hidden_ = layers_[0].o.N;
    inter_ = layers_[0].gate_up.N / 2;
    for (const auto& l : layers_) {
      TORCH_CHECK(l.qkv.N == (H_ + 2 * KVH_) * D_ && l.qkv.K == hidden_ && l.o.K == H_ * D_ && l.o.N == hidden_ &&
                  l.gate_up.K == hidden_ && l.gate_up.N == 2 * inter_ && l.down.K == inter_ && l.down.N == hidden_,
                  "stack layer shapes disagree");
    }
  }

  // The final hidden states [B, hidden] (after the final norm) of one decode step: x the
  // input embeddings [B, hidden], cos/sin [B, D], the caches [slots, KVH, D] per layer,
  // pages [B, P] page ids, lens [B] context lengths (the new token included), slots [B]
  // where each row's new K/V go.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, torch::Tensor pages, int64_t page_size, torch::Tensor lens,
                        torch::Tensor slots) {
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_, "x: float32 [B, hidden]");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L, "one cache per layer");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos/sin: float32");
    const int64_t B = x.size(0), H = H_, KVH = KVH_, D = D_, W = (H + 2 * KVH) * D;
    const auto opts = x.options();
    auto resid = x.contiguous().clone();
    auto hidden = torch::empty({B, hidden_}, opts), delta = torch::empty({B, hidden_}, opts);
    auto qkv = torch::empty({B, W}, opts), q = torch::empty({B, H, D}, opts), k = torch::empty({B, KVH, D}, opts);
    auto attn = torch::empty({B, H * D}, opts);
    auto gu = torch::empty({B, 2 * inter_}, opts), act = torch::empty({B, inter_}, opts);
    cos = cos.contiguous();
    sin = sin.contiguous();
    pages = pages.to(at::kLong).contiguous();
    lens = lens.to(at::kLong).contiguous();
    slots = slots.to(at::kLong).contiguous();
    float* r = resid.data_ptr<float>();
    float* h = hidden.data_ptr<float>();
    float* dl = delta.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    const int64_t P = pages.size(1);
    auto attend = D == 64 ? decode_rows<float, 64> : D == 128 ? decode_rows<float, 128> : decode_rows<float, 0>;
    for (int64_t i = 0; i < L; ++i) {
      const StackLayer& layer = layers_[i];
      const auto& kc = k_caches[i];
      const auto& vc = v_caches[i];
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
                  "caches: contiguous float32");
      add_rms_norm_rows<float>(r, i == 0 ? nullptr : dl, layer.norm1.data_ptr<float>(), r, h, B, hidden_, eps_);
      layer.qkv.run(h, B, qkvp);
      rope_store_rows<float>(qkvp, qkvp + H * D, qkvp + (H + KVH) * D, cos.data_ptr<float>(), sin.data_ptr<float>(),
                             q.data_ptr<float>(), k.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                             slots.data_ptr<int64_t>(), B, H, KVH, D, W, D, W, D, W, D);
      attend(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), pages.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
             attn.data_ptr<float>(), B, H, D, KVH, P, page_size, scale_);
      layer.o.run(attn.data_ptr<float>(), B, dl);
      add_rms_norm_rows<float>(r, dl, layer.norm2.data_ptr<float>(), r, h, B, hidden_, eps_);
      layer.gate_up.run(h, B, gu.data_ptr<float>());
      silu_mul_rows<float>(gu.data_ptr<float>(), act.data_ptr<float>(), B, inter_);
      layer.down.run(act.data_ptr<float>(), B, dl);
    }
    auto out = torch::empty({B, hidden_}, opts);
    add_rms_norm_rows<float>(r, dl, final_norm_.data_ptr<float>(), r, out.data_ptr<float>(), B, hidden_, eps_);
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  static at::Tensor float_tensor(const c10::optional<torch::Tensor>& t) {
    TORCH_CHECK(t.has_value() && t->scalar_type() == at::kFloat && t->is_contiguous(), "a contiguous float32 tensor");
    return *t;
  }
  static StackLinear linear(const std::vector<c10::optional<torch::Tensor>>& t, size_t at) {
    StackLinear out;
    TORCH_CHECK(t[at].has_value() && t[at]->scalar_type() == at::kByte && t[at]->is_contiguous(), "codes: contiguous uint8");
    out.codes = *t[at];
    out.scale = float_tensor(t[at + 1]);
    if (t[at + 2].has_value()) out.minimum = float_tensor(t[at + 2]);
    if (t[at + 3].has_value()) out.bias = float_tensor(t[at + 3]);
    out.N = out.codes.size(0);
    out.K = out.scale.size(1) * kBlock;
    TORCH_CHECK(out.codes.size(1) == (out.minimum.defined() ? out.K / 2 : out.K), "codes and scales disagree");
    return out;
  }

  std::vector<StackLayer> layers_;
  at::Tensor final_norm_;
  float eps_;
  int64_t H_, KVH_, D_, hidden_ = 0, inter_ = 0;
  float scale_;
};
"""

BINDINGS = r"""
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<const std::vector<std::vector<c10::optional<torch::Tensor>>>&, torch::Tensor, double, int64_t, int64_t, int64_t,
                    double>())
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("num_layers", &DecodeStack::num_layers);
"""


def _linear_entries(linear: Any) -> list[torch.Tensor | None] | None:
    blocks = getattr(linear, "blocks", None)
    if blocks is None:
        return None
    return [blocks.codes, blocks.scale, blocks.minimum, blocks.bias]


def stack_layers(model: torch.nn.Module) -> list[list[torch.Tensor | None]] | None:
    """The per-layer entries :class:`DecodeStack` takes, or None when the model is not one
    the stack computes exactly as the per-op path does (a layer in float weights, a
    per-head q/k norm, activations other than float32)."""
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None:
            return None
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if any(w.dtype != torch.float32 for w in norms):
            return None
        linears = [_linear_entries(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(e is None for e in linears):
            return None
        layers.append([w.detach() for w in norms] + [t for e in linears for t in e])
    return layers or None


class CpuDecodeStack:
    """The decode step's layers and final norm of ``model`` in one C++ call (see the
    module's docstring); :meth:`for_model` says whether the model can run on it."""

    def __init__(self, model: torch.nn.Module, layers: list[list[torch.Tensor | None]]) -> None:
        from .cpu_kernels import load

        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.stack = load().DecodeStack(layers, model.model.norm.weight.detach(), float(model.model.norm.eps), attn.num_heads,
                                        attn.num_kv_heads, attn.head_dim, float(attn.scale))
        self.num_layers = cfg.num_layers

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "CpuDecodeStack | None":
        layers = stack_layers(model)
        return None if layers is None else cls(model, layers)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Any, pages: torch.Tensor, kv_lens: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
        """The final hidden states of a decode step's rows (the final norm applied)."""
        return self.stack.forward(x, cos, sin, kv.k, kv.v, pages, kv.page_size, kv_lens, slots)
