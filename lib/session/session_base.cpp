#include <nlohmann/json.hpp>

#include "fullshard/session/session_base.hpp"

#include <utility>

#include "fullshard/base/error.hpp"
#include "lib/checkpoint/index_json.hpp"
#include "lib/session/session_core.hpp"

namespace fullshard::session {

std::string SessionBase::save(const std::string& dir) {
  return core_->save(dir);
}
void SessionBase::save_async(const std::string& dir) {
  core_->save_async(dir);
}
bool SessionBase::save_in_flight() const noexcept {
  return core_->in_flight;
}
bool SessionBase::poll_save() {
  return core_->poll_save();
}
std::string SessionBase::wait_save() {
  return core_->wait_save();
}
std::int64_t SessionBase::load(const std::string& dir) {
  return core_->load(dir);
}
void SessionBase::export_safetensors(const std::string& path) {
  core_->export_safetensors(path);
}
checkpoint::SafetensorsLoaded SessionBase::import_safetensors(const std::string& path, bool cast) {
  return core_->import_safetensors(path, cast);
}
const checkpoint::Loaded& SessionBase::last_loaded() const noexcept {
  return core_->last_loaded;
}
checkpoint::Loaded SessionBase::load_parameters(const std::string& dir) {
  return core_->load_parameters(dir);
}
void SessionBase::set_checkpoint_metadata(const std::string& text) {
  nlohmann::json extra = checkpoint::parse_metadata(text, "set_checkpoint_metadata");
  if (!extra.is_object() || extra.contains("session"))
    throw InvalidArgument(
        "set_checkpoint_metadata: the metadata must be a JSON object without the key "
        "\"session\" (the session's own), not " +
        extra.dump().substr(0, 200));
  core_->metadata_extra = std::move(extra);
}
double SessionBase::last_load_seconds() const noexcept {
  return core_->last_load_seconds;
}
const schedule::MemoryAccount& SessionBase::planned_memory() const noexcept {
  return core_->planned;
}
std::uint64_t SessionBase::reserve_async_staging() {
  return core_->reserve_async_staging();
}
void SessionBase::set_progress(Progress progress) {
  core_->progress = std::move(progress);
}
const Config& SessionBase::config() const noexcept {
  return core_->cfg;
}
const DeviceMesh& SessionBase::mesh() const noexcept {
  return core_->mesh;
}
std::int64_t SessionBase::step() const noexcept {
  return core_->step;
}
std::int64_t SessionBase::skipped_steps() const noexcept {
  return core_->non_finite->skipped();
}
double SessionBase::lr() const {
  return core_->lr();
}
std::size_t SessionBase::optimizer_tensors() const {
  return core_->opt->tensors();
}
const PlanPrediction& SessionBase::plan() const noexcept {
  return core_->plan;
}

}  // namespace fullshard::session
