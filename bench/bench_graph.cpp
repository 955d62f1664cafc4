// fullshard-bench-graph: graph JSON loading time against the size of the graph (issue 13:
// loading must be linear in the file's size). No MPI: run it directly.
//
//   load/siblings/<N>      parse_graph_json of a root with N sibling modules, each
//                          {"name": "m<i>", "params": {"w": {"shape": [4, 4]}}} (400,000: 20 MB)
//   load/params/<N>        a root with one module holding N parameters "p<i>" of shape [4]
//   load/depth/<N>         N nested modules (N = 256 is the limit), a parameter in the innermost
//   refuse/depth/<N>       N nested modules, N beyond the limit: the time to refuse the file
//   refuse/json_depth/<N>  a module whose fully_shard value is N nested objects: time to refuse
//
// Counters: MB (the text's size) and MB_per_s. The text is built once per benchmark, outside
// the timed region; the loaded tree is destroyed inside it (freeing is part of the cost).
//
//   build/bench/fullshard-bench-graph [--benchmark_filter=siblings]
#include <benchmark/benchmark.h>

#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"

namespace {

std::string siblings(int n) {
  std::string s = R"({"name": "model", "modules": [)";
  for (int i = 0; i < n; ++i)
    s += (i ? ", " : "") + std::string(R"({"name": "m)") + std::to_string(i) +
         R"(", "params": {"w": {"shape": [4, 4]}}})";
  return s + "]}";
}

std::string params(int n) {
  std::string s = R"({"name": "model", "modules": [{"name": "big", "params": {)";
  for (int i = 0; i < n; ++i)
    s += (i ? ", " : "") + std::string("\"p") + std::to_string(i) + R"(": {"shape": [4]})";
  return s + "}}]}";
}

std::string nested(int n, const std::string& inner = R"(, "params": {"w": {"shape": [2]}})") {
  std::string s = R"({"name": "model")";
  for (int i = 0; i < n; ++i)
    s += R"(, "modules": [{"name": "m")";
  s += inner;
  for (int i = 0; i < n; ++i)
    s += "}]";
  return s + "}";
}

std::string deep_fully_shard(int n) {
  std::string s = R"({"name": "m", "fully_shard": )";
  for (int i = 0; i < n; ++i)
    s += R"({"a": )";
  s += "1";
  s += std::string(static_cast<std::size_t>(n), '}');
  return s + "}";
}

void run(benchmark::State& state, const std::string& text, bool refused) {
  for (auto _ : state) {
    try {
      auto g = fullshard::graph::parse_graph_json(text, "bench.json");
      benchmark::DoNotOptimize(g.get());
      if (refused) state.SkipWithError("expected the graph to be refused");
    } catch (const fullshard::ConfigError& e) {
      if (!refused) state.SkipWithError(e.what());
    }
  }
  const double mb = static_cast<double>(text.size()) / 1e6;
  state.counters["MB"] = mb;
  state.counters["MB_per_s"] =
      benchmark::Counter(mb * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_siblings(benchmark::State& state) {
  run(state, siblings(static_cast<int>(state.range(0))), false);
}
void BM_params(benchmark::State& state) {
  run(state, params(static_cast<int>(state.range(0))), false);
}
void BM_depth(benchmark::State& state) {
  run(state, nested(static_cast<int>(state.range(0))), false);
}
void BM_refuse_depth(benchmark::State& state) {
  run(state, nested(static_cast<int>(state.range(0))), true);
}
void BM_refuse_json_depth(benchmark::State& state) {
  run(state, deep_fully_shard(static_cast<int>(state.range(0))), true);
}

BENCHMARK(BM_siblings)
    ->Name("load/siblings")
    ->Arg(25000)
    ->Arg(100000)
    ->Arg(400000)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(BM_params)
    ->Name("load/params")
    ->Arg(50000)
    ->Arg(200000)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(BM_depth)->Name("load/depth")->Arg(256)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_refuse_depth)->Name("refuse/depth")->Arg(12000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_refuse_json_depth)
    ->Name("refuse/json_depth")
    ->Arg(50000)
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
