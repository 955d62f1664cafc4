#include <doctest/doctest.h>

#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/runtime/settings.hpp"
#include "lib/base/message_of.hpp"

using fullshard::ConfigError;
using fullshard::HostProgress;
using fullshard::Settings;

namespace {
std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    Settings::from_map(vars);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("settings defaults and valid values") {
  const Settings d = Settings::from_map({});
  CHECK(d.timeout_s == 600.0);
  CHECK(d.host_progress == HostProgress::inline_);
  CHECK(d.ranks_per_node == 0);
  const Settings s = Settings::from_map({{"FULLSHARD_TIMEOUT", "2.5"},
                                         {"FULLSHARD_LOG_LEVEL", "debug"},
                                         {"FULLSHARD_HOST_PROGRESS", "thread"},
                                         {"FULLSHARD_RANKS_PER_NODE", "2"},
                                         {"FULLSHARD_BIND_DEVICE", "0"},
                                         {"OTHER_VAR", "ignored"}});
  CHECK(s.timeout_s == 2.5);
  CHECK(s.log_level == 3);
  CHECK(s.host_progress == HostProgress::thread);
  CHECK(s.ranks_per_node == 2);
  CHECK_FALSE(s.bind_device);
  CHECK(s.warnings.empty());
}

TEST_CASE("a bad setting is an error naming the variable and the value") {
  // Plain references, not structured bindings: CAPTURE's lambda captures them (C++17).
  for (const auto& entry : std::map<std::string, std::string>{{"FULLSHARD_TIMEOUT", "abc"},
                                                              {"FULLSHARD_LOG_LEVEL", "loud"},
                                                              {"FULLSHARD_HOST_PROGRESS", "async"},
                                                              {"FULLSHARD_RANKS_PER_NODE", "0"},
                                                              {"FULLSHARD_BIND_DEVICE", "yes"}}) {
    const std::string& var = entry.first;
    const std::string& value = entry.second;
    const std::string msg = error_of({{var, value}});
    CAPTURE(var);
    CHECK(msg.find(var) != std::string::npos);
    CHECK(msg.find("'" + value + "'") != std::string::npos);
  }
  CHECK(error_of({{"FULLSHARD_TIMEOUT", "-1"}}).find("positive") != std::string::npos);
  // Out of range: refused at start (1e10 s used to overflow the clock deadline of every
  // collective, aborting the first one), not capped silently.
  for (const char* big : {"1e10", "9.3e9", "1000000.5", "1e300"}) {
    CAPTURE(big);
    const std::string msg = error_of({{"FULLSHARD_TIMEOUT", big}});
    CHECK_MESSAGE(msg.find("at most 1000000") != std::string::npos, msg);
  }
  CHECK(Settings::from_map({{"FULLSHARD_TIMEOUT", "1e6"}}).timeout_s == 1e6);
  CHECK(Settings::from_map({{"FULLSHARD_TIMEOUT", "1e-3"}}).timeout_s == 1e-3);
  // Every bad value is a SettingsError: what the apps exit 2 for, like a bad option.
  for (const auto& entry :
       std::map<std::string, std::string>{{"FULLSHARD_TIMEOUT", "1e10"},
                                          {"FULLSHARD_LOG_LEVEL", "loud"},
                                          {"FULLSHARD_CKPT_FAULT", "nowhere"}}) {
    const std::string& var = entry.first;
    const std::string& value = entry.second;
    CAPTURE(var);
    CHECK_THROWS_AS(Settings::from_map({{var, value}}), fullshard::SettingsError);
  }
  CHECK(error_of({{"FULLSHARD_TIMEOUT", "inf"}}) != "");
  CHECK(error_of({{"FULLSHARD_RANKS_PER_NODE", "3x"}}) != "");
}

TEST_CASE("FULLSHARD_CKPT_FAULT: a known point, optionally on one rank") {
  const Settings s = Settings::from_map({{"FULLSHARD_CKPT_FAULT", "mid_index@3"}});
  CHECK(s.checkpoint_fault.point == "mid_index");
  CHECK(s.checkpoint_fault.rank == 3);
  CHECK(s.warnings.empty());
  CHECK(Settings::from_map({{"FULLSHARD_CKPT_FAULT", "after_shards"}}).checkpoint_fault.rank == -1);
  CHECK(Settings::from_map({{"FULLSHARD_CKPT_FAULT", "prepare_tensor@1"}}).checkpoint_fault.point ==
        "prepare_tensor");
  CHECK(Settings::from_map({}).checkpoint_fault.point.empty());
  const std::string msg = error_of({{"FULLSHARD_CKPT_FAULT", "mid_shrad"}});
  CHECK(msg.find("FULLSHARD_CKPT_FAULT='mid_shrad'") != std::string::npos);
  CHECK(msg.find("mid_shard, after_shards") != std::string::npos);
  CHECK(error_of({{"FULLSHARD_CKPT_FAULT", "mid_shard@x"}}) != "");
}

TEST_CASE("an unknown FULLSHARD_ variable is reported, FULLSHARD_ROOT is not") {
  const Settings s = Settings::from_map({{"FULLSHARD_TIMOUT", "5"}, {"FULLSHARD_ROOT", "/opt"}});
  REQUIRE(s.warnings.size() == 1);
  CHECK(s.warnings[0].find("FULLSHARD_TIMOUT") != std::string::npos);
  CHECK(s.timeout_s == 600.0);
}

TEST_CASE("Error: the rank prefix once, and the message without it for wrapping") {
  const fullshard::InvalidArgument e("module 'm': bad shape");
  const std::string what = e.what();
  CHECK(what.rfind("fullshard[rank ", 0) == 0);
  CHECK(what.size() > std::string(e.message()).size());
  CHECK(std::string(e.message()) == "module 'm': bad shape");
  CHECK(fullshard::detail::message_of(e) == "module 'm': bad shape");
  const std::runtime_error other("plain");
  CHECK(fullshard::detail::message_of(other) == "plain");
}
