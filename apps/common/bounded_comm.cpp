#include "bounded_comm.hpp"

namespace fullshard::apps {

void agree_on_options(fullshard::BoundedComm& world, const std::vector<OptionValue>& options) {
  std::vector<std::string> items;
  items.reserve(options.size());
  for (const OptionValue& o : options)
    items.push_back(o.first + '\0' + o.second);
  const std::size_t d = first_difference(world, items, "comparing the options of every rank");
  if (d == kNoDifference) return;
  if (d == 0) throw OptionMismatch{"", "the ranks were started with different numbers of options"};
  const OptionValue& o = options[d - 1];
  throw OptionMismatch{o.first, o.first + " differs between ranks (this rank: " + o.first + " " +
                                    o.second + "); start every rank with the same options"};
}

}  // namespace fullshard::apps
