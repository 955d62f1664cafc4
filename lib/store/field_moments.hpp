// A consumer's running moments of each field, and the one pass that ingests an arriving sample:
// it copies the sample from its staging slot into its buffer slot and adds its values to the
// moments as it goes, so that a sample is read once.
#pragma once

#include <cstddef>
#include <vector>

#include "fullshard/store/sample_store.hpp"
#include "lib/store/sample_layout.hpp"

namespace fullshard::store {

/// Count, mean and sum of squared deviations (M2), merged with Chan et al.'s formula.
struct RunningMoments {
  double count = 0;
  double mean = 0;
  double m2 = 0;

  void merge(const RunningMoments& o);
  /// The population standard deviation, sqrt(M2 / count).
  FieldMoments result() const;
};

/// Copies the packed `sample` into `slot` (the buffer slot the policy gave it; nullptr when the
/// policy did not keep it: then only the moments) and merges each non-mask field's values into
/// `moments` (by field). Each field's values are summed as deviations from the field's first
/// value in this sample, so that the sums keep their precision whatever the values' magnitude.
void copy_and_measure(const std::vector<Field>& fields, const SampleLayout& layout,
                      const std::byte* sample, std::byte* slot,
                      std::vector<RunningMoments>& moments);

}  // namespace fullshard::store
