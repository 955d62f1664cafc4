// Handles of the C API: a handle is a 64-bit value, kind (8 bits) | generation (24 bits) |
// slot + 1 (32 bits), so that a freed handle (its slot's generation moved on), a handle of
// another kind and a made-up value are all found out, never dereferenced. The kinds: 1 mesh,
// 2 model, 3 save (lib/capi/c_api.cpp), 4 store (lib/capi/store_api.cpp). Private to lib/capi.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"

namespace fullshard::capi {

/// A handle that does not name a live object of the table's kind.
class HandleError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

template <class T>
class HandleTable {
 public:
  /// `gone`: what happened to a handle whose object is gone ("freed (fullshard_<name>_free)"
  /// unless given).
  HandleTable(std::uint8_t kind, const char* name, std::string gone = {})
      : kind_(kind),
        name_(name),
        gone_(gone.empty() ? "freed (fullshard_" + std::string(name) + "_free)" : std::move(gone)) {
  }

  std::uint64_t add(std::shared_ptr<T> object) {
    std::size_t slot = 0;
    while (slot < slots_.size() && slots_[slot].object)
      ++slot;
    if (slot == slots_.size()) slots_.push_back({});
    Slot& s = slots_[slot];
    s.generation = (s.generation + 1) & 0xFFFFFF;
    if (s.generation == 0) s.generation = 1;
    s.object = std::move(object);
    return (std::uint64_t(kind_) << 56) | (std::uint64_t(s.generation) << 32) |
           std::uint64_t(slot + 1);
  }

  /// The object of a live handle; HandleError naming `what` (the argument) otherwise.
  const std::shared_ptr<T>& get(std::uint64_t id, const char* what) const {
    return slots_[index(id, what)].object;
  }

  /// Frees a live handle's slot (the object lives on while others hold it).
  std::shared_ptr<T> remove(std::uint64_t id, const char* what) {
    return std::move(slots_[index(id, what)].object);
  }

  /// Every live object, in slot order, taken out of the table.
  std::vector<std::shared_ptr<T>> clear() {
    std::vector<std::shared_ptr<T>> out;
    for (Slot& s : slots_)
      if (s.object) out.push_back(std::move(s.object));
    return out;
  }

 private:
  struct Slot {
    std::uint32_t generation = 0;
    std::shared_ptr<T> object;
  };

  std::size_t index(std::uint64_t id, const char* what) const {
    if (id == 0) throw HandleError(std::string(what) + " is the null " + name_ + " handle");
    const std::uint8_t kind = std::uint8_t(id >> 56);
    const std::uint32_t generation = std::uint32_t(id >> 32) & 0xFFFFFF;
    const std::uint64_t slot = (id & 0xFFFFFFFFu) - 1;
    if (kind != kind_)
      throw HandleError(std::string(what) + " is not a " + name_ + " handle" +
                        (kind >= 1 && kind <= 4 ? " (it is a handle of another kind)"
                                                : " (a value fullshard never returned)"));
    if (slot >= slots_.size() || generation == 0 || slots_[slot].generation < generation)
      throw HandleError(std::string(what) + " is not a " + name_ +
                        " handle fullshard returned (a made-up or corrupted value)");
    if (slots_[slot].generation != generation || !slots_[slot].object)
      throw HandleError(std::string(what) + " is a " + name_ + " handle that was " + gone_);
    return std::size_t(slot);
  }

  std::uint8_t kind_;
  const char* name_;
  std::string gone_;
  std::vector<Slot> slots_;
};

}  // namespace fullshard::capi
