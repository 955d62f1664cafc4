// Offline conversion between sharded and full checkpoints (fullshard-ckpt convert): no MPI,
// one tensor shard in memory at a time, every byte read verified.
#include <algorithm>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "lib/checkpoint/index_json.hpp"
#include "lib/checkpoint/io.hpp"

namespace fullshard::checkpoint {

namespace {

std::string rank_file(int q) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.bin", q);
  return buf;
}

}  // namespace

std::string convert(const std::string& src, const std::string& dst, const ConvertOptions& options) {
  if (options.block_bytes == 0 || options.block_bytes > kMaxBlockBytes)
    throw InvalidArgument("checkpoint convert: block_bytes must be in [1, " +
                          std::to_string(kMaxBlockBytes) + "], got " +
                          std::to_string(options.block_bytes));
  if (options.shards < 0)
    throw InvalidArgument("checkpoint convert: --shards must be >= 1, got " +
                          std::to_string(options.shards));
  Reader reader(src);
  const Index& in = reader.index();
  int shards = 1;
  if (options.to == Kind::sharded) {
    shards = options.shards;
    if (shards == 0) {
      for (const FileInfo& f : in.files)
        shards += f.bytes > 0 ? 1 : 0;
      shards = std::max(1, shards);
    }
  }
  Index out = in;
  out.kind = options.to;
  out.block_bytes = options.block_bytes;
  out.files.clear();
  for (TensorInfo& t : out.tensors)
    t.shards.clear();
  out.saved_by = nlohmann::json{
      {"converted_from", reader.step_dir()},
      {"original", nlohmann::json::parse(in.saved_by)},
      {"shards",
       shards}}.dump();
  // Layouts first: a tensor that cannot be split this way fails before anything is written.
  for (const TensorInfo& t : in.tensors)
    if (options.to == Kind::sharded && t.placement.is_shard())
      (void)shard_layout(t.global_shape, t.placement, shards, 0, "tensor '" + t.name + "'");

  const detail::Fault fault = detail::Fault::from_environment();
  const detail::PendingStep pending = detail::begin_step(dst, in.step);
  try {
    detail::ByteBuffer buf;
    for (int q = 0; q < shards; ++q) {
      const std::string name = options.to == Kind::full ? "model.bin" : rank_file(q);
      detail::DataFileWriter w(detail::join(pending.tmp, name), out.block_bytes, fault);
      for (std::size_t i = 0; i < in.tensors.size(); ++i) {
        const TensorInfo& t = in.tensors[i];
        ShardInfo s;
        if (options.to == Kind::full || t.placement.is_replicate()) {
          if (q != 0) continue;
          s.global_offset.assign(t.global_shape.size(), 0);
          s.shape = t.global_shape;
        } else {
          const ShardLayout l = shard_layout(t.global_shape, t.placement, shards, q, t.name);
          s.global_offset = l.global_offset;
          s.shape = l.local_shape;
        }
        if (numel(s.shape) == 0) continue;
        buf.resize(static_cast<std::size_t>(numel(s.shape)) * dtype_size(t.dtype));
        reader.read_box(t, s.global_offset, s.shape, buf.data());
        w.append(buf.data(), buf.size(), s, t.name);
        s.file = out.files.size();
        out.tensors[i].shards.push_back(std::move(s));
      }
      w.finish();
      out.files.push_back({name, w.bytes()});
    }
    const std::string where = detail::join(pending.tmp, "index.json");
    out = index_from_json(to_json(out), where);
    return detail::commit_step(pending, to_json(out).dump(1), fault);
  } catch (...) {
    detail::abandon_step(pending);
    throw;
  }
}

}  // namespace fullshard::checkpoint
