// The texts the store's messages are made of: shapes, indices, rank lists, values and the
// names of its enums, written the same way in every error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fullshard/store/sample_store.hpp"

namespace fullshard::store {

/// "[3, 4]".
std::string shape_text(const std::vector<std::int64_t>& shape);
/// The row-major multi-index of flat element `e` of `shape`, as shape_text writes it.
std::string index_text(const std::vector<std::int64_t>& shape, std::int64_t e);
/// "0, 2, 3".
std::string ranks_text(const std::vector<int>& ranks);
/// printf's %g: "0.5", "nan", "-inf".
std::string value_text(double v);

const char* policy_name(Policy p);
const char* delivery_name(Delivery d);
const char* role_name(Role r);

}  // namespace fullshard::store
