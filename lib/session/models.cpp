#include "lib/session/models.hpp"

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include <algorithm>
#include <string>
#include <utility>

#include "fullshard/base/checked.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/torch/deferred_init.hpp"
#include "fullshard/torch/gpt.hpp"
#include "fullshard/torch/init.hpp"
#include "fullshard/torch/residual_mlp.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "lib/checkpoint/torchscript_archive.hpp"

namespace fullshard::session {

namespace fst = fullshard::torch;
namespace nn = ::torch::nn;

namespace {

enum class Activation { relu, gelu, tanh, silu };

Activation parse_activation(const std::string& a) {
  if (a == "gelu") return Activation::gelu;
  if (a == "tanh") return Activation::tanh;
  if (a == "silu") return Activation::silu;
  return Activation::relu;
}

at::Tensor activate(const at::Tensor& x, Activation a) {
  switch (a) {
    case Activation::gelu:
      return at::gelu(x);
    case Activation::tanh:
      return at::tanh(x);
    case Activation::silu:
      return at::silu(x);
    case Activation::relu:
      break;
  }
  return at::relu(x);
}

std::string shape_of(const at::Tensor& t) {
  std::string s = "(";
  for (std::int64_t d = 0; d < t.dim(); ++d)
    s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

void check_count(const std::vector<at::Tensor>& in, std::size_t n, const std::string& model) {
  if (in.size() != n)
    throw InvalidArgument("the " + model + " takes " + std::to_string(n) + " input" +
                          (n == 1 ? "" : "s") + ", not " + std::to_string(in.size()));
}

// ---- mlp ---------------------------------------------------------------------------------

// One hidden layer: activation(x W^T + b).
class DenseBlockImpl : public nn::Module {
 public:
  DenseBlockImpl(std::int64_t in, std::int64_t out, Activation a)
      : linear(register_module("linear", nn::Linear(in, out))), act_(a) {}
  at::Tensor forward(const at::Tensor& x) { return activate(linear(x), act_); }
  nn::Linear linear;

 private:
  Activation act_;
};

// Deferred: a piece released to the meta device as soon as it is built.
template <class M>
M made(M m, bool deferred) {
  if (deferred) fst::to_meta(*m);
  return m;
}

class MlpImpl : public nn::Module {
 public:
  explicit MlpImpl(const ModelSpec& s) {
    auto list = register_module("blocks", nn::ModuleList());
    std::int64_t in = s.inputs;
    for (std::int64_t h : s.hidden) {
      blocks.push_back(made(std::make_shared<DenseBlockImpl>(in, h, parse_activation(s.activation)),
                            s.deferred_init));
      list->push_back(blocks.back());
      in = h;
    }
    output = register_module("output", made(nn::Linear(in, s.outputs), s.deferred_init));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks)
      x = fst::call(b, x);
    return output(x);
  }
  std::vector<std::shared_ptr<DenseBlockImpl>> blocks;
  nn::Linear output{nullptr};
};

// ---- conv_autoencoder --------------------------------------------------------------------

// A 3x3 convolution (stride 1 or 2, padding 1) and the activation.
class ConvBlockImpl : public nn::Module {
 public:
  ConvBlockImpl(std::int64_t in, std::int64_t out, std::int64_t stride, Activation a)
      : conv(register_module("conv",
                             nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1)))),
        act_(a) {}
  at::Tensor forward(const at::Tensor& x) { return activate(conv(x), act_); }
  nn::Conv2d conv;

 private:
  Activation act_;
};

// A 4x4 transposed convolution of stride 2 (doubles H and W) and the activation.
class UpBlockImpl : public nn::Module {
 public:
  UpBlockImpl(std::int64_t in, std::int64_t out, Activation a)
      : conv(register_module(
            "conv",
            nn::ConvTranspose2d(nn::ConvTranspose2dOptions(in, out, 4).stride(2).padding(1)))),
        act_(a) {}
  at::Tensor forward(const at::Tensor& x) { return activate(conv(x), act_); }
  nn::ConvTranspose2d conv;

 private:
  Activation act_;
};

// (N, C, H, W) -> (N, C_out, H, W): a stride-1 block to `width` channels, `levels` blocks that
// halve H and W and double the channels, as many that undo it, and a 3x3 output convolution.
class ConvAutoencoderImpl : public nn::Module {
 public:
  explicit ConvAutoencoderImpl(const ModelSpec& s) {
    const Activation a = parse_activation(s.activation);
    auto list = register_module("blocks", nn::ModuleList());
    const bool d = s.deferred_init;
    down.push_back(made(std::make_shared<ConvBlockImpl>(s.channels, s.width, 1, a), d));
    list->push_back(down.back());
    std::int64_t w = s.width;
    for (std::int64_t l = 0; l < s.levels; ++l, w *= 2) {
      down.push_back(made(std::make_shared<ConvBlockImpl>(w, 2 * w, 2, a), d));
      list->push_back(down.back());
    }
    for (std::int64_t l = 0; l < s.levels; ++l, w /= 2) {
      up.push_back(made(std::make_shared<UpBlockImpl>(w, w / 2, a), d));
      list->push_back(up.back());
    }
    output = register_module(
        "output", made(nn::Conv2d(nn::Conv2dOptions(s.width, s.out_channels, 3).padding(1)), d));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : down)
      x = fst::call(b, x);
    for (auto& b : up)
      x = fst::call(b, x);
    return output(x);
  }
  std::vector<std::shared_ptr<ConvBlockImpl>> down;  // blocks.0 .. blocks.<levels>
  std::vector<std::shared_ptr<UpBlockImpl>> up;      // the blocks after them
  nn::Conv2d output{nullptr};
};

// ---- torchscript -------------------------------------------------------------------------

// A scripted module's tree as nn::Modules holding the same parameter tensors (the same
// TensorImpls: fully_shard's in-place changes reach the scripted module), so the LibTorch
// front end can mirror and shard it. Buffers stay in the scripted module, whole.
class ScriptMirror : public nn::Module {
 public:
  explicit ScriptMirror(::torch::jit::Module m) : script(std::move(m)) {
    for (const auto& p : script.named_parameters(/*recurse=*/false))
      register_parameter(p.name, p.value, p.value.requires_grad());
    for (const auto& c : script.named_children())
      children_.push_back(register_module(c.name, std::make_shared<ScriptMirror>(c.value)));
  }
  at::Tensor forward(const at::Tensor& x) { return script.forward({x}).toTensor(); }
  ::torch::jit::Module script;

 protected:
  std::vector<std::shared_ptr<ScriptMirror>> children_;
};

// A scripted nn.Sequential: its children (the blocks fully_shard wraps) called in order
// through fullshard::torch::call.
class ScriptSequential : public ScriptMirror {
 public:
  using ScriptMirror::ScriptMirror;
  at::Tensor forward(at::Tensor x) {
    for (auto& b : children_)
      x = fst::call(b, x);
    return x;
  }
  const std::vector<std::shared_ptr<ScriptMirror>>& blocks() const { return children_; }
};

// Any other scripted module: one communication group (the root), its forward called with
// every input; a tensor, a tuple or a list of tensors comes back.
class ScriptModel : public ScriptMirror {
 public:
  using ScriptMirror::ScriptMirror;
  std::vector<at::Tensor> forward(std::vector<at::Tensor> in) {
    const c10::IValue r = script.forward(std::vector<c10::IValue>(in.begin(), in.end()));
    if (r.isTensor()) return {r.toTensor()};
    if (r.isTensorList()) return r.toTensorVector();
    std::vector<at::Tensor> out;
    if (r.isTuple())
      for (const c10::IValue& e : r.toTupleRef().elements()) {
        if (!e.isTensor()) break;
        out.push_back(e.toTensor());
      }
    if (!r.isTuple() || out.empty() || out.size() != r.toTupleRef().elements().size())
      throw InvalidArgument("the TorchScript model returned a " + r.tagKind() +
                            "; fullshard takes a tensor, a tuple or a list of tensors");
    return out;
  }
};

::torch::jit::Module load_script(const std::string& file, const std::string& source) {
  // LibTorch trusts the archive (a short tensor record is read past its end): checked first.
  try {
    checkpoint::check_torchscript_archive(file);
  } catch (const IoError& e) {
    throw IoError(source + ": model.file: " + e.message());
  }
  ::torch::jit::Module m;
  try {
    m = ::torch::jit::load(file);
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    throw ConfigError(
        source + ": model.file: cannot load the TorchScript file '" + file + "' (" + what +
        "); it must be saved by torch.jit.save from a PyTorch no newer than this "
        "LibTorch (" +
        std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + ")");
  }
  return m;
}

// Whether a scripted module is an nn.Sequential: its type's qualified name without the
// "___torch_mangle_<n>." parts TorchScript inserts when a process scripts several distinct
// Sequentials ("__torch__.torch.nn.modules.container.___torch_mangle_1.Sequential").
bool is_sequential(const ::torch::jit::Module& m) {
  const auto name = m.type()->name();
  if (!name) return false;
  std::string q = name->qualifiedName();
  for (std::size_t at; (at = q.find("___torch_mangle_")) != std::string::npos;) {
    const std::size_t dot = q.find('.', at);
    q.erase(at, dot == std::string::npos ? std::string::npos : dot + 1 - at);
  }
  return q == "__torch__.torch.nn.modules.container.Sequential" ||
         q == "torch.nn.modules.container.Sequential";
}

}  // namespace

BuiltModel build_model(const ModelSpec& s, at::ScalarType dtype, const std::string& source,
                       std::uint64_t seed) {
  BuiltModel b;
  b.input_dtype = dtype;
  if (s.type == "mlp" || s.type == "residual_mlp") {
    const std::int64_t inputs = s.inputs;
    const std::string name = s.type;
    if (s.type == "mlp") {
      auto m = std::make_shared<MlpImpl>(s);
      if (s.deferred_init) b.initialize = fst::rule_initializer(fst::default_init_rules(*m), seed);
      for (auto& blk : m->blocks)
        b.blocks.push_back(blk.get());
      b.forward = [m](const std::vector<at::Tensor>& in) mutable {
        return std::vector<at::Tensor>{fst::call(m, in[0])};
      };
      b.root = m;
    } else {
      fst::ResidualMlp m(
          fst::ResidualMlpConfig{s.inputs, s.hidden[0], s.outputs, s.blocks, s.deferred_init});
      if (s.deferred_init) b.initialize = m->initializer(seed);
      for (auto& blk : m->block_list)
        b.blocks.push_back(blk.get());
      b.forward = [m](const std::vector<at::Tensor>& in) mutable {
        return std::vector<at::Tensor>{fst::call(m, in[0])};
      };
      b.root = m.ptr();
    }
    b.check_inputs = [inputs, name](const std::vector<at::Tensor>& in) {
      check_count(in, 1, name);
      if (in[0].dim() < 1 || in[0].size(-1) != inputs)
        throw InvalidArgument("input 0 has shape " + shape_of(in[0]) + "; the " + name +
                              " takes (batch, " + std::to_string(inputs) + ")");
    };
  } else if (s.type == "gpt") {
    fst::GptConfig c;
    c.vocab = s.vocab;
    c.context = s.context;
    c.d_model = s.d_model;
    c.heads = s.heads;
    c.layers = s.layers;
    c.mlp_ratio = s.mlp_ratio;
    c.checkpoint_blocks = s.checkpoint_blocks;
    c.dropout = s.dropout;
    c.deferred = s.deferred_init;
    c.seed = seed;
    fst::Gpt m(c);
    if (c.deferred) b.initialize = [m](const fst::LocalShard& shard) { m->init_weights(shard); };
    for (auto& blk : m->block_list)
      b.blocks.push_back(blk.ptr().get());
    b.forward = [m](const std::vector<at::Tensor>& in) mutable {
      return std::vector<at::Tensor>{fst::call(m, in[0])};
    };
    b.own_loss = [m](const std::vector<at::Tensor>& in) mutable { return m->loss(in[0]); };
    b.input_dtype = at::kLong;
    const std::int64_t context = s.context + 1, vocab = s.vocab;
    b.check_inputs = [context, vocab](const std::vector<at::Tensor>& in) {
      check_count(in, 1, "gpt");
      if (in[0].dim() != 2 || in[0].size(1) < 2 || in[0].size(1) > context)
        throw InvalidArgument("input 0 has shape " + shape_of(in[0]) +
                              "; the gpt takes token ids (batch, time) with 2 <= time <= " +
                              std::to_string(context) + " (context + 1)");
      if (!at::isIntegralType(in[0].scalar_type(), /*includeBool=*/false))
        throw InvalidArgument("input 0 is " + std::string(at::toString(in[0].scalar_type())) +
                              "; the gpt takes integer token ids (Long or Int)");
      if (in[0].numel() == 0) return;
      // A token outside the vocabulary would index past the embedding table.
      const at::Tensor ids = in[0];
      const at::Tensor outside = at::logical_or(ids < 0, ids >= vocab);
      if (!outside.any().item<bool>()) return;
      const at::Tensor where = outside.nonzero()[0];
      const std::int64_t row = where[0].item<std::int64_t>(), col = where[1].item<std::int64_t>();
      throw InvalidArgument("input 0 holds token " +
                            std::to_string(ids[row][col].item<std::int64_t>()) + " at [" +
                            std::to_string(row) + ", " + std::to_string(col) +
                            "]; the gpt's vocabulary is [0, " + std::to_string(vocab) + ")");
    };
    b.root = m.ptr();
  } else if (s.type == "conv_autoencoder") {
    auto m = std::make_shared<ConvAutoencoderImpl>(s);
    if (s.deferred_init) b.initialize = fst::rule_initializer(fst::default_init_rules(*m), seed);
    for (auto& blk : m->down)
      b.blocks.push_back(blk.get());
    for (auto& blk : m->up)
      b.blocks.push_back(blk.get());
    b.forward = [m](const std::vector<at::Tensor>& in) mutable {
      return std::vector<at::Tensor>{fst::call(m, in[0])};
    };
    const std::int64_t channels = s.channels, multiple = std::int64_t{1} << s.levels;
    b.check_inputs = [channels, multiple](const std::vector<at::Tensor>& in) {
      check_count(in, 1, "conv_autoencoder");
      if (in[0].dim() != 4 || in[0].size(1) != channels || in[0].size(2) % multiple != 0 ||
          in[0].size(3) % multiple != 0)
        throw InvalidArgument("input 0 has shape " + shape_of(in[0]) +
                              "; the conv_autoencoder takes (batch, " + std::to_string(channels) +
                              ", H, W) with H and W multiples of " + std::to_string(multiple));
    };
    b.root = m;
  } else {
    ::torch::jit::Module script = load_script(s.file, source);
    if (is_sequential(script)) {
      auto m = std::make_shared<ScriptSequential>(std::move(script));
      if (m->blocks().empty())
        throw ConfigError(source + ": model.file: '" + s.file + "' is an empty Sequential");
      for (auto& blk : m->blocks())
        b.blocks.push_back(blk.get());
      b.forward = [m](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{fst::call(m, in[0])};
      };
      b.check_inputs = [](const std::vector<at::Tensor>& in) {
        check_count(in, 1, "scripted Sequential");
      };
      b.root = m;
    } else {
      auto m = std::make_shared<ScriptModel>(std::move(script));
      b.forward = [m](const std::vector<at::Tensor>& in) { return fst::call(m, in); };
      b.check_inputs = [](const std::vector<at::Tensor>&) {};
      b.root = m;
    }
  }
  if (dtype != at::kFloat) b.root->to(dtype);
  return b;
}

std::int64_t parameter_count(const ModelSpec& s, const std::string& source) {
  const std::string what = source + ": the model's parameter count";
  auto mul = [&](std::int64_t a, std::int64_t b) { return checked_mul<ConfigError>(a, b, what); };
  auto add = [&](std::int64_t a, std::int64_t b) { return checked_add<ConfigError>(a, b, what); };
  // A Linear (or a k x k convolution) from a to b: its weight and bias.
  auto linear = [&](std::int64_t a, std::int64_t b, std::int64_t k2 = 1) {
    return add(mul(mul(a, b), k2), b);
  };
  std::int64_t n = 0;
  if (s.type == "mlp") {
    std::int64_t in = s.inputs;
    for (std::int64_t h : s.hidden) {
      n = add(n, linear(in, h));
      in = h;
    }
    return add(n, linear(in, s.outputs));
  }
  if (s.type == "residual_mlp") {
    const std::int64_t h = s.hidden.empty() ? 0 : s.hidden[0];
    n = add(linear(s.inputs, h), linear(h, s.outputs));
    return add(n, mul(s.blocks, mul(2, linear(h, h))));
  }
  if (s.type == "gpt") {  // the output head is the token embedding (tied)
    const std::int64_t d = s.d_model, r = mul(s.mlp_ratio, d);
    const std::int64_t block = add(add(add(mul(4, d), linear(d, mul(3, d))), linear(d, d)),
                                   add(linear(d, r), linear(r, d)));
    n = add(mul(add(s.vocab, s.context), d), mul(2, d));
    return add(n, mul(s.layers, block));
  }
  if (s.type == "conv_autoencoder") {
    n = linear(s.channels, s.width, 9);
    std::int64_t w = s.width;
    for (std::int64_t l = 0; l < s.levels; ++l, w = mul(w, 2))
      n = add(n, linear(w, mul(2, w), 9));
    for (std::int64_t l = 0; l < s.levels; ++l, w /= 2)
      n = add(n, linear(w, w / 2, 16));
    return add(n, linear(s.width, s.out_channels, 9));
  }
  return -1;
}

}  // namespace fullshard::session
