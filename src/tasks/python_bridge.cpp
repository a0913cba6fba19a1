#include "tasks/python_bridge.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>

#include "core/error.h"

#ifdef FP8RL_HAVE_PYTHON
#include <pybind11/embed.h>
#endif

namespace fp8rl {

#ifndef FP8RL_HAVE_PYTHON

namespace {
[[noreturn]] void no_python(const std::string& what) {
  FP8RL_FAIL(what, " needs Python, and this fp8rl was built without it: install python3-dev and pybind11-dev "
             "(scripts/install-deps.sh) and rebuild (CMake option FP8RL_PYTHON=ON)");
}
}  // namespace

bool python_available() { return false; }
std::vector<nlohmann::json> python_read_table(const std::string& path) {
  no_python("reading '" + path + "' (parquet / HF dataset)");
}
struct PythonReward::Impl {};
PythonReward::PythonReward(const std::string& spec) : spec_(spec) { no_python("task.reward.python"); }
PythonReward::~PythonReward() = default;
PythonRewardResult PythonReward::score(const std::vector<nlohmann::json>&) const { no_python("task.reward.python"); }

#else

namespace py = pybind11;

namespace {

// Helpers run inside the interpreter (kept in one namespace dict, not in __main__).
const char* kHelpers = R"PY(
import importlib, importlib.util, json, os, sys, glob, traceback

def load_function(spec):
    module, _, name = spec.rpartition(':')
    if module.endswith('.py'):
        if not os.path.exists(module):
            raise FileNotFoundError(f"task.reward.python: file '{module}' does not exist")
        mod_name = '_fp8rl_reward_' + os.path.splitext(os.path.basename(module))[0]
        s = importlib.util.spec_from_file_location(mod_name, module)
        m = importlib.util.module_from_spec(s)
        sys.modules[mod_name] = m
        s.loader.exec_module(m)
    else:
        m = importlib.import_module(module)
    if not hasattr(m, name):
        funcs = sorted(k for k, v in vars(m).items() if callable(v) and not k.startswith('_'))
        raise AttributeError(f"module '{module}' has no function '{name}' (it defines: {', '.join(funcs) or 'nothing callable'})")
    f = getattr(m, name)
    if not callable(f):
        raise TypeError(f"'{spec}' is not a function")
    return f

def format_exception(e, tb):
    return ''.join(traceback.format_exception(type(e), e, tb if tb is not None else e.__traceback__))

def read_table(path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading '{path}' needs pyarrow in the Python fp8rl embeds ({sys.executable}, "
                          f"Python {sys.version.split()[0]}): pip install pyarrow")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, 'dataset_dict.json')):
            splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
            raise ValueError(f"'{path}' is a DatasetDict with splits {splits}: point at one split's folder, "
                             f"e.g. {os.path.join(path, splits[0] if splits else 'train')}")
        if os.path.exists(os.path.join(path, 'state.json')):
            with open(os.path.join(path, 'state.json')) as f:
                state = json.load(f)
            files = [os.path.join(path, d['filename']) for d in state.get('_data_files', [])]
            tables = []
            for fn in files:
                with pa.memory_map(fn) as src:
                    try:
                        tables.append(pa.ipc.open_stream(src).read_all())
                    except pa.ArrowInvalid:
                        tables.append(pa.ipc.open_file(src).read_all())
        else:
            files = sorted(glob.glob(os.path.join(path, '*.parquet')))
            tables = [pq.read_table(fn) for fn in files]
        if not tables:
            raise ValueError(f"'{path}' holds no parquet files and no HF dataset (state.json)")
        table = pa.concat_tables(tables)
    else:
        table = pq.read_table(path)
    return json.dumps(table.to_pylist(), default=str)
)PY";

py::dict& helpers() {
  static py::dict* d = nullptr;  // created once under the GIL, never destroyed (lives with the interpreter)
  if (!d) {
    d = new py::dict();
    (*d)["__builtins__"] = py::module_::import("builtins");
    py::exec(kHelpers, *d);
  }
  return *d;
}

void ensure_interpreter() {
  static std::once_flag once;
  std::call_once(once, [] {
    py::initialize_interpreter();
    {
      py::list path = py::module_::import("sys").attr("path");
      path.insert(0, py::str(std::filesystem::current_path().string()));
      helpers();
    }
    // Release the GIL; every call below takes it with gil_scoped_acquire. The interpreter is
    // never finalized: it ends with the process (finalizing after numpy / pyarrow is fragile).
    PyEval_SaveThread();
  });
}

std::string format_exception(const py::error_already_set& e) {
  try {
    return helpers()["format_exception"](e.value(), e.trace()).cast<std::string>();
  } catch (...) {
    return e.what();
  }
}

// The message of a Python exception alone ("ModuleNotFoundError: No module named 'x'").
std::string exception_line(const py::error_already_set& e) {
  try {
    const std::string type = py::str(e.type().attr("__name__"));
    return type + ": " + std::string(py::str(e.value()));
  } catch (...) {
    return e.what();
  }
}

std::string clip(const std::string& s, size_t n) { return s.size() <= n ? s : s.substr(0, n) + "...(" + std::to_string(s.size()) + " bytes)"; }

}  // namespace

bool python_available() { return true; }

std::vector<nlohmann::json> python_read_table(const std::string& path) {
  ensure_interpreter();
  std::string text;
  {
    py::gil_scoped_acquire gil;
    try {
      text = helpers()["read_table"](path).cast<std::string>();
    } catch (py::error_already_set& e) {
      FP8RL_FAIL("cannot read dataset '", path, "': ", exception_line(e));
    }
  }
  const nlohmann::json rows = nlohmann::json::parse(text);
  return rows.get<std::vector<nlohmann::json>>();
}

struct __attribute__((visibility("hidden"))) PythonReward::Impl {
  py::object fn;
};

PythonReward::PythonReward(const std::string& spec) : spec_(spec), impl_(std::make_unique<Impl>()) {
  if (spec.find(':') == std::string::npos)
    FP8RL_FAIL("task.reward.python: '", spec, "' must look like module:function or path/to/file.py:function");
  ensure_interpreter();
  py::gil_scoped_acquire gil;
  try {
    impl_->fn = helpers()["load_function"](spec);
  } catch (py::error_already_set& e) {
    const std::string module = spec.substr(0, spec.rfind(':'));
    if (e.matches(PyExc_ModuleNotFoundError) && module.size() > 3 && module.compare(module.size() - 3, 3, ".py") != 0)
      FP8RL_FAIL("task.reward.python: cannot import module '", module, "' (", exception_line(e),
                 "): put its folder on PYTHONPATH, or give the file: path/to/", module, ".py:",
                 spec.substr(spec.rfind(':') + 1));
    FP8RL_FAIL("task.reward.python: cannot load '", spec, "':\n", format_exception(e));
  }
}

PythonReward::~PythonReward() {
  if (impl_ && impl_->fn) {
    py::gil_scoped_acquire gil;
    impl_->fn = py::object();
  }
}

PythonRewardResult PythonReward::score(const std::vector<nlohmann::json>& samples) const {
  py::gil_scoped_acquire gil;
  py::object loads = py::module_::import("json").attr("loads");
  // Invalid UTF-8 (a byte-level tokenizer can decode half a character) becomes U+FFFD.
  const auto replace = nlohmann::json::error_handler_t::replace;
  py::object batch = loads(nlohmann::json(samples).dump(-1, ' ', false, replace));
  py::object out;
  try {
    out = impl_->fn(batch);
  } catch (py::error_already_set& e) {
    const std::string trace = format_exception(e);
    // Which sample? The first that fails on its own (the function may fail only on the batch).
    std::string which = "no single sample fails on its own; the batch as a whole does";
    for (size_t i = 0; i < samples.size(); ++i) {
      py::list one;
      one.append(py::list(batch)[i]);
      try {
        impl_->fn(one);
      } catch (py::error_already_set&) {
        which = "the first sample that fails on its own is #" + std::to_string(i) + ": " +
                clip(samples[i].dump(-1, ' ', false, replace), 2000);
        break;
      }
    }
    FP8RL_FAIL("task.reward.python '", spec_, "' raised an exception:\n", trace, which);
  }
  PythonRewardResult r;
  auto bad = [&](const std::string& what) {
    FP8RL_FAIL("task.reward.python '", spec_, "' must return one float (or one dict with a 'reward') per sample: ",
               what);
  };
  if (!py::isinstance<py::sequence>(out) || py::isinstance<py::str>(out))
    bad("it returned " + std::string(py::str(out.get_type().attr("__name__"))));
  py::sequence seq = out.cast<py::sequence>();
  if (seq.size() != samples.size())
    bad("it returned " + std::to_string(seq.size()) + " values for " + std::to_string(samples.size()) + " samples");
  std::map<std::string, std::pair<double, int>> sums;
  std::vector<std::string> order;
  auto number = [&](py::handle v, size_t i, const std::string& key) -> double {
    if (!py::isinstance<py::float_>(v) && !py::isinstance<py::int_>(v) &&
        !py::hasattr(v, "__float__"))
      bad("sample #" + std::to_string(i) + (key.empty() ? "" : " key '" + key + "'") + " is " +
          std::string(py::str(py::repr(v))));
    const double d = v.cast<double>();
    if (!std::isfinite(d)) bad("sample #" + std::to_string(i) + " got a non-finite reward " + std::to_string(d));
    return d;
  };
  for (size_t i = 0; i < seq.size(); ++i) {
    py::object v = seq[i];
    if (py::isinstance<py::dict>(v)) {
      py::dict d = v.cast<py::dict>();
      if (!d.contains("reward")) bad("sample #" + std::to_string(i) + " returned a dict without a 'reward' key");
      r.rewards.push_back(number(d["reward"], i, "reward"));
      for (auto kv : d) {
        const std::string k = py::str(kv.first);
        if (k == "reward") continue;
        if (!py::isinstance<py::float_>(kv.second) && !py::isinstance<py::int_>(kv.second)) continue;  // text: not a metric
        const double x = kv.second.cast<double>();
        if (!std::isfinite(x)) continue;
        if (!sums.count(k)) order.push_back(k);
        sums[k].first += x;
        sums[k].second += 1;
      }
    } else {
      r.rewards.push_back(number(v, i, ""));
    }
  }
  for (const std::string& k : order) r.metrics.push_back({k, sums[k].first / sums[k].second});
  return r;
}

#endif

}  // namespace fp8rl
