// JSONL datasets (user data and GSM8K): one JSON object per line with configurable fields.
#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/error.h"
#include "io/json_input.h"
#include "tasks/answer.h"
#include "tasks/procedural.h"
#include "tokenizer/utf8.h"

namespace fp8rl {
namespace {

std::string trim(const std::string& s) {
  const char* ws = " \t\r\n";
  const size_t b = s.find_first_not_of(ws);
  return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// GSM8K solutions carry calculator annotations "<<48/2=24>>": drop them.
std::string strip_annotations(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t open = s.find("<<", i), close = open == std::string::npos ? open : s.find(">>", open);
    if (close == std::string::npos) {
      out += s.substr(i);
      break;
    }
    out += s.substr(i, open - i);
    i = close + 2;
  }
  return out;
}

// One record per line; a line longer than this is refused before it is parsed or tokenized (a
// prompt that long could never fit a model's context).
constexpr size_t kMaxLineBytes = size_t(1) << 20;

// std::getline without the unbounded string: reads at most kMaxLineBytes before failing.
bool read_line_limited(std::istream& in, std::string& line, const std::string& path, size_t line_no) {
  line.clear();
  for (int ch; (ch = in.get()) != EOF;) {
    if (ch == '\n') return true;
    if (line.size() == kMaxLineBytes)
      FP8RL_FAIL(path, ":", line_no, ": line is longer than ", kMaxLineBytes >> 20,
                 " MiB; a JSONL record must hold one prompt/answer, and no model context fits a prompt this long");
    line.push_back(static_cast<char>(ch));
  }
  return !line.empty();
}

std::vector<TaskItem> read_jsonl(const std::string& path, const JsonlConfig& cfg) {
  std::ifstream f(path, std::ios::binary);
  FP8RL_CHECK(f.good(), cfg.name, ": cannot open ", path);
  std::vector<TaskItem> items;
  std::string line;
  size_t line_no = 0;
  auto field = [&](const nlohmann::json& j, const std::string& key, bool allow_number) -> std::string {
    if (!j.contains(key)) FP8RL_FAIL(path, ":", line_no, ": missing field \"", key, "\"");
    const nlohmann::json& v = j[key];
    if (v.is_string()) return v.get<std::string>();
    if (allow_number && v.is_number()) return v.dump();
    FP8RL_FAIL(path, ":", line_no, ": field \"", key, "\" must be a string", allow_number ? " or a number" : "",
               ", got ", v.type_name());
  };
  while (read_line_limited(f, line, path, line_no + 1)) {
    ++line_no;
    if (trim(line).empty()) continue;
    FP8RL_CHECK(utf8_is_valid(line), path, ":", line_no, ": line is not valid UTF-8");
    const nlohmann::json j = json_parse_limited(line, path + ":" + std::to_string(line_no), {kMaxLineBytes, 16});
    FP8RL_CHECK(j.is_object(), path, ":", line_no, ": each line must be a JSON object");
    TaskItem it;
    it.prompt = field(j, cfg.prompt_field, false);
    if (!cfg.instruction.empty()) it.prompt += "\n" + cfg.instruction;
    const std::string answer = field(j, cfg.answer_field, true);
    if (cfg.answer_after_hashes) {
      const size_t h = answer.rfind("####");
      FP8RL_CHECK(h != std::string::npos, path, ":", line_no, ": field \"", cfg.answer_field,
                  "\" has no '#### <answer>' line");
      it.answer = trim(answer.substr(h + 4));
      it.solution = strip_annotations(answer);
    } else {
      it.answer = trim(answer);
    }
    if (!cfg.solution_field.empty()) it.solution = field(j, cfg.solution_field, false);
    FP8RL_CHECK(!it.answer.empty(), path, ":", line_no, ": empty answer");
    items.push_back(std::move(it));
  }
  FP8RL_CHECK(!items.empty(), path, ": no items");
  return items;
}

class JsonlTask : public Task {
 public:
  explicit JsonlTask(const JsonlConfig& cfg) : name_(cfg.name) {
    std::vector<TaskItem> all = read_jsonl(cfg.train_path, cfg);
    std::unordered_set<std::string> seen;
    if (!cfg.validation_path.empty()) {
      for (TaskItem& it : read_jsonl(cfg.validation_path, cfg))
        if (seen.insert(it.prompt).second) validation_.push_back(std::move(it));
    }
    std::vector<TaskItem> pool;  // unique prompts not in validation, in file order
    for (TaskItem& it : all)
      if (seen.insert(it.prompt).second) pool.push_back(std::move(it));
    TaskRng rng(cfg.seed ^ 0x5eed5eed5eedull);
    for (size_t i = pool.size(); i > 1; --i) std::swap(pool[i - 1], pool[rng.next() % i]);
    if (cfg.validation_path.empty()) {
      FP8RL_CHECK(cfg.validation_fraction > 0 && cfg.validation_fraction < 1, name_,
                  ": validation_fraction must be in (0, 1) without a validation file");
      const size_t n_val = std::max<size_t>(1, size_t(cfg.validation_fraction * double(pool.size())));
      FP8RL_CHECK(pool.size() > n_val, cfg.train_path, ": too few distinct items (", pool.size(),
                  ") to hold out a validation split; add items or set task.jsonl.validation_path");
      validation_.assign(std::make_move_iterator(pool.end() - long(n_val)), std::make_move_iterator(pool.end()));
      pool.resize(pool.size() - n_val);
    }
    train_ = std::move(pool);
  }
  std::string name() const override { return name_; }
  size_t size(Split s) const override { return s == Split::kTrain ? train_.size() : validation_.size(); }
  TaskItem item(Split s, size_t i) const override {
    const auto& v = s == Split::kTrain ? train_ : validation_;
    FP8RL_CHECK(i < v.size(), name_, ": item ", i, " is out of range (split size ", v.size(), ")");
    return v[i];
  }
  double reward(std::string_view response, const std::string& answer) const override {
    const auto got = answer_extract(response);
    return got && answer_equal(*got, answer) ? 1.0 : 0.0;
  }

 private:
  std::string name_;
  std::vector<TaskItem> train_, validation_;
};

}  // namespace

std::unique_ptr<Task> task_make_jsonl(const JsonlConfig& cfg) { return std::make_unique<JsonlTask>(cfg); }

std::unique_ptr<Task> task_make_gsm8k(const std::string& dir, uint64_t seed) {
  JsonlConfig c;
  c.name = "gsm8k";
  c.train_path = dir + "/train.jsonl";
  c.validation_path = dir + "/test.jsonl";
  c.prompt_field = "question";
  c.answer_field = "answer";
  c.answer_after_hashes = true;
  c.instruction = kMathInstruction;
  c.seed = seed;
  return task_make_jsonl(c);
}

}  // namespace fp8rl
