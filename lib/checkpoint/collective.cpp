#include "lib/checkpoint/collective.hpp"

#include "fullshard/base/error.hpp"

namespace fullshard::checkpoint::detail {

std::unique_ptr<Comm> checkpoint_comm(MPI_Comm parent, double timeout_s, const std::string& what) {
  return Comm::duplicate(parent, "checkpoint", timeout_s,
                         "another rank is not taking part (it never called the checkpoint "
                         "function, failed outside it, or is stuck)",
                         what);
}

void agree(Comm& c, const std::exception_ptr& err, const char* what) {
  const int first =
      c.allreduce(err ? c.rank() : c.size(), MPI_MIN, "MPI_Iallreduce (agreeing on errors)");
  if (first == c.size()) return;
  int type = 0;
  std::string msg;
  if (c.rank() == first) {
    try {
      std::rethrow_exception(err);
    } catch (const InvalidArgument& e) {
      type = 1, msg = e.what();
    } catch (const ConfigError& e) {
      type = 2, msg = e.what();
    } catch (const CommError& e) {
      type = 3, msg = e.what();
    } catch (const IoError& e) {
      type = 4, msg = e.what();
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
      msg = "unknown exception";
    }
  }
  c.bcast(&type, 1, MPI_INT, first, "MPI_Ibcast");
  bcast_string(c, msg, first);
  if (c.rank() == first) std::rethrow_exception(err);
  const std::string text = std::string(what) + " failed on another rank: " + msg;
  switch (type) {
    case 1:
      throw InvalidArgument(text);
    case 2:
      throw ConfigError(text);
    case 3:
      throw CommError(text);
    case 4:
      throw IoError(text);
    default:
      throw Error(text);
  }
}

}  // namespace fullshard::checkpoint::detail
