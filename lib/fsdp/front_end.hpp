// What a front end (a tensor library whose autograd drives the FSDP hooks, e.g.
// fullshard::torch) needs of fully_shard beyond the native API: its own gradients. The hooks
// themselves are those of hooks.hpp, called in the order the library's autograd fires them;
// the parameters follow every show through a graph::ParameterBinding.
#pragma once

#include "fullshard/fsdp/fully_shard.hpp"

namespace fullshard::fsdp {

/// The unsharded gradients of `st`'s group come from the front end: pre-backward allocates
/// and zeroes nothing (grad() becomes none, or keeps what a no_sync backward left), and before
/// the module's post-backward the front end registers each parameter's unsharded gradient
/// with Parameter::set_grad (param dtype, the parameter's numel; none reads as zeros). The
/// reduce-scatter copy-in reads them where they are and holds them until it ran. Call it
/// right after fully_shard, before the first backward.
void use_external_gradients(FSDPModule& st);

}  // namespace fullshard::fsdp
