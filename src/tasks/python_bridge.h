// Embedded CPython (pybind11, CMake option FP8RL_PYTHON): user reward functions and table
// datasets (parquet files, Hugging Face `save_to_disk` directories) read through pyarrow.
// The interpreter starts on first use, reads PYTHONPATH as python3 does, puts the current
// directory first on sys.path, and then releases the GIL: it is held only around each call.
// Without Python in the build every entry point throws an Error that says how to get it.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace fp8rl {

// True when this fp8rl embeds Python.
bool python_available();

// The rows of a table dataset as JSON objects: a .parquet file, a directory of .parquet files,
// or an HF `Dataset.save_to_disk` directory (state.json + Arrow files; for a DatasetDict point at
// one split's folder). Needs pyarrow in the embedded Python; errors name the path.
std::vector<nlohmann::json> python_read_table(const std::string& path);

struct PythonRewardResult {
  std::vector<double> rewards;                              // [samples]
  std::vector<std::pair<std::string, double>> metrics;      // extra dict keys: batch means
};

// task.reward.python = "module:function" (imported from sys.path) or "path/file.py:function".
// The function is called once per batch as score(samples: list[dict]) and returns list[float]
// or list[dict] with a "reward" (other numeric keys are averaged into metrics).
class PythonReward {
 public:
  explicit PythonReward(const std::string& spec);  // imports now: a bad spec fails at start-up
  ~PythonReward();
  PythonReward(const PythonReward&) = delete;
  PythonReward& operator=(const PythonReward&) = delete;
  // samples: JSON objects (prompt, response, answer and the dataset row's fields). A Python
  // exception throws Error with the traceback and the first sample that fails on its own; a
  // malformed result (wrong length, non-finite or non-numeric reward) says what was returned.
  PythonRewardResult score(const std::vector<nlohmann::json>& samples) const;
  const std::string& spec() const { return spec_; }

 private:
  struct Impl;
  std::string spec_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp8rl
