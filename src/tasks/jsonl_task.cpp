// JSONL datasets (user data and GSM8K): one JSON object per line with configurable fields.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/error.h"
#include "io/json_input.h"
#include "tasks/answer.h"
#include "tasks/procedural.h"
#include "tasks/python_bridge.h"
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

// The rows of a dataset file with where each came from ("file:LINE" for JSONL, "file row N" for
// tables): JSONL line by line, anything else (.parquet, a directory) through the embedded Python.
struct Row {
  nlohmann::json j;
  std::string where;
};

bool is_jsonl(const std::string& path) {
  auto ends = [&](const char* e) {
    const size_t n = std::strlen(e);
    return path.size() >= n && path.compare(path.size() - n, n, e) == 0;
  };
  return ends(".jsonl") || ends(".json") || ends(".jsonl.txt");
}

std::vector<Row> read_rows(const std::string& path, const std::string& task) {
  std::vector<Row> rows;
  if (!std::filesystem::exists(path)) FP8RL_FAIL(task, ": dataset '", path, "' does not exist");
  if (!is_jsonl(path)) {
    size_t i = 0;
    for (nlohmann::json& j : python_read_table(path)) {
      rows.push_back({std::move(j), path + " row " + std::to_string(i)});
      ++i;
    }
    return rows;
  }
  std::ifstream f(path, std::ios::binary);
  if (!f.good()) FP8RL_FAIL(task, ": cannot open ", path);
  std::string line;
  size_t line_no = 0;
  while (read_line_limited(f, line, path, line_no + 1)) {
    ++line_no;
    if (trim(line).empty()) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    if (!utf8_is_valid(line)) FP8RL_FAIL(where, ": line is not valid UTF-8");
    rows.push_back({json_parse_limited(line, where, {kMaxLineBytes, 16}), where});
  }
  return rows;
}

// Field `key` of a row: the key itself, else a dotted path into nested objects ("a.b.c").
const nlohmann::json* lookup(const nlohmann::json& j, const std::string& key) {
  if (!j.is_object()) return nullptr;
  if (auto it = j.find(key); it != j.end()) return &*it;
  const nlohmann::json* cur = &j;
  for (size_t s = 0;;) {
    const size_t dot = key.find('.', s);
    const std::string part = key.substr(s, dot == std::string::npos ? dot : dot - s);
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(part);
    if (it == cur->end()) return nullptr;
    cur = &*it;
    if (dot == std::string::npos) return cur;
    s = dot + 1;
  }
}

std::string available_fields(const nlohmann::json& j) {
  std::string s;
  for (auto it = j.begin(); it != j.end(); ++it) s += (s.empty() ? "" : ", ") + it.key();
  return s.empty() ? "none" : s;
}

// A field as text: strings as they are, numbers as JSON, a chat (list of {role, content}) as its
// last user message's content.
std::string field_text(const Row& row, const std::string& key, bool allow_number) {
  const nlohmann::json* v = lookup(row.j, key);
  if (!v) FP8RL_FAIL(row.where, ": missing field \"", key, "\" (the row has: ", available_fields(row.j), ")");
  if (v->is_string()) return v->get<std::string>();
  if (allow_number && v->is_number()) return v->dump();
  if (v->is_array() && !v->empty()) {
    std::string last;
    for (const auto& m : *v)
      if (m.is_object() && m.value("role", "") == "user" && m.contains("content") && m["content"].is_string())
        last = m["content"].get<std::string>();
    if (!last.empty()) return last;
  }
  FP8RL_FAIL(row.where, ": field \"", key, "\" must be a string", allow_number ? " or a number" : "",
             " (or a chat with a user message), got ", v->type_name());
}

// {field} / {a.b} replaced by the row's values; {{ and }} are literal braces; "{}" and braces
// around anything that is not a field name stay as written (LaTeX: \boxed{}).
std::string render_template(const std::string& tpl, const Row& row) {
  std::string out;
  for (size_t i = 0; i < tpl.size(); ++i) {
    if (tpl.compare(i, 2, "{{") == 0 || tpl.compare(i, 2, "}}") == 0) {
      out += tpl[i];
      ++i;
      continue;
    }
    if (tpl[i] == '{') {
      const size_t close = tpl.find('}', i);
      const std::string name = close == std::string::npos ? "" : tpl.substr(i + 1, close - i - 1);
      const bool is_name = !name.empty() && name.find_first_not_of(
          "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.") == std::string::npos;
      if (is_name) {
        if (!lookup(row.j, name))
          FP8RL_FAIL(row.where, ": task.jsonl.prompt_template names {", name, "}, which the row lacks (the row has: ",
                     available_fields(row.j), ")");
        out += field_text(row, name, true);
        i = close;
        continue;
      }
    }
    out += tpl[i];
  }
  return out;
}

std::vector<TaskItem> read_jsonl(const std::string& path, const JsonlConfig& cfg) {
  std::vector<TaskItem> items;
  for (const Row& row : read_rows(path, cfg.name)) {
    if (!row.j.is_object())
      FP8RL_FAIL(row.where, is_jsonl(path) ? ": each line must be a JSON object" : ": each row must be an object",
                 ", got ", row.j.type_name());
    TaskItem it;
    it.prompt = cfg.prompt_template.empty() ? field_text(row, cfg.prompt_field, false)
                                            : render_template(cfg.prompt_template, row);
    if (!cfg.instruction.empty()) it.prompt += "\n" + cfg.instruction;
    const std::string answer = field_text(row, cfg.answer_field, true);
    if (cfg.answer_after_hashes) {
      const size_t h = answer.rfind("####");
      if (h == std::string::npos)
        FP8RL_FAIL(row.where, ": field \"", cfg.answer_field, "\" has no '#### <answer>' line");
      it.answer = trim(answer.substr(h + 4));
      it.solution = strip_annotations(answer);
    } else {
      it.answer = trim(answer);
    }
    if (!cfg.solution_field.empty()) it.solution = field_text(row, cfg.solution_field, false);
    if (it.answer.empty()) FP8RL_FAIL(row.where, ": field \"", cfg.answer_field, "\" is empty");
    it.fields_json = row.j.dump();
    items.push_back(std::move(it));
  }
  if (items.empty()) FP8RL_FAIL(cfg.name, ": '", path, "' holds no items (no rows)");
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
    return got && answer_equal_normalized(*got, answer) ? 1.0 : 0.0;
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
