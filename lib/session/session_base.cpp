#include "fullshard/session/session_base.hpp"

#include <utility>

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
void SessionBase::import_safetensors(const std::string& path) {
  core_->import_safetensors(path);
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
