// model_weights_save (weights.h): HF checkpoints in BF16/F32, FP8 block format, sharded.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "core/precision.h"
#include "io/safetensors.h"
#include "model/weights.h"
#include "quant/quant.h"

namespace fp8rl {
namespace {

namespace sfs = std::filesystem;

const char* torch_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    default: FP8RL_FAIL("checkpoints are saved in F32 or BF16, not ", dtype_name(t));
  }
}

// Removes what an earlier save left (model.safetensors, shards, index) so that the directory
// holds exactly one consistent set.
void remove_old_weights(const std::string& dir) {
  for (const auto& e : sfs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    const bool shard = n.rfind("model-", 0) == 0 && n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0;
    if (n == "model.safetensors" || n == "model.safetensors.index.json" || shard) sfs::remove(e.path());
  }
}

// "model.layers.{i}.<self_attn|mlp>.<x>_proj.weight" (experts too; MLA's
// kv_a_proj_with_mqa.weight) -> i, else -1: the linears the FP8 block format may store as F8_E4M3.
int fp8_candidate_layer(const std::string& name) {
  auto ends_with = [&](const std::string& s) {
    return name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  const bool linear = name.rfind("model.layers.", 0) == 0 &&
                      (ends_with("_proj.weight") || ends_with(".kv_a_proj_with_mqa.weight"));
  return linear ? std::stoi(name.substr(13)) : -1;
}

// An MLA projection whose widths the recipe cannot block (kv_a_proj_with_mqa) stays BF16 as in
// the FP8 engines (model_linear_mode).
bool stored_fp8(const std::string& name, const Tensor& t, const SaveOptions& opt, const ModelConfig& c) {
  const int layer = fp8_candidate_layer(name), num_layers = c.num_layers;
  if (!opt.fp8_block || layer < 0) return false;
  if (name.find(".self_attn.") != std::string::npos && t.ndim() == 2 && mla_projection_kept_bf16(c, t.dim(0), t.dim(1)))
    return false;
  EnginePrecision fp8;
  fp8.linear = LinearMode::FP8_BLOCK;
  fp8.bf16_first_layers = opt.bf16_first_layers;
  fp8.bf16_last_layers = opt.bf16_last_layers;
  return fp8.linear_for_layer(layer, num_layers) == LinearMode::FP8_BLOCK;
}

}  // namespace

std::string hf_dequantize_block_misread(int64_t out, int64_t in) {
  const int64_t gr = (out + kQuantBlock - 1) / kQuantBlock, gc = (in + kQuantBlock - 1) / kQuantBlock;
  const bool rows_ok = gr == 1 || out == gr * kQuantBlock, cols_ok = gc == 1 || in == gc * kQuantBlock;
  if (rows_ok && cols_ok) return "";
  if (out % gr != 0 || in % gc != 0)
    return "refused (\"Weight shape (" + std::to_string(out) + ", " + std::to_string(in) +
           ") not divisible by scale grid (" + std::to_string(gr) + ", " + std::to_string(gc) + ")\")";
  return "read with " + std::to_string(out / gr) + "x" + std::to_string(in / gc) +
         " blocks instead of 128x128: silently wrong weights";
}

std::vector<std::string> model_fp8_hf_dequantize_misreads(const ModelWeights& w, const SaveOptions& opt) {
  std::vector<std::string> out;
  model_for_each_parameter(w, [&](const std::string& name, const Tensor& t) {
    if (!stored_fp8(name, t, opt, w.config) || t.ndim() != 2) return;
    const std::string why = hf_dequantize_block_misread(t.dim(0), t.dim(1));
    if (why.empty()) return;
    const int64_t gr = (t.dim(0) + kQuantBlock - 1) / kQuantBlock, gc = (t.dim(1) + kQuantBlock - 1) / kQuantBlock;
    out.push_back(name.substr(0, name.size() - 7) + " [" + std::to_string(t.dim(0)) + ", " +
                  std::to_string(t.dim(1)) + "] scales [" + std::to_string(gr) + ", " + std::to_string(gc) +
                  "]: " + why);
  });
  return out;
}

void model_weights_save(const ModelWeights& w, const std::string& dir, const SaveOptions& opt) {
  std::error_code ec;
  sfs::create_directories(dir, ec);
  FP8RL_CHECK(!ec && sfs::is_directory(dir), "cannot create directory '", dir, "': ", ec.message());
  FP8RL_CHECK(opt.dtype == DType::F32 || opt.dtype == DType::BF16, "checkpoints are saved in F32 or BF16, not ",
              dtype_name(opt.dtype));
  const int L = w.config.num_layers;
  // 1. The tensors in their stored form, in model_for_each_parameter's order.
  for (size_t i = 0; i < w.layers.size(); ++i)
    FP8RL_CHECK((w.layers[i].q.w.defined() || w.layers[i].q_a.w.defined()) &&
                    (w.layers[i].is_moe() ? w.layers[i].experts[0].down.w.defined() : w.layers[i].down.w.defined()),
                "cannot save layer ", i,
                ": it has only an FP8 copy (keep the high-precision weight to save)");
  std::vector<std::pair<std::string, Tensor>> params;  // as held (F32 master)
  model_for_each_parameter(w, [&](const std::string& name, const Tensor& t) {
    FP8RL_CHECK(t.device() == DeviceKind::CPU, "model_weights_save needs host tensors (", name, " is ", t.str(),
                "); use model_weights_to_host first");
    params.push_back({name, t});
  });
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<std::string> kept_linears;  // FP8 format: linears left in high precision
  for (auto& [name, t] : params) tensors.push_back({name, t.dtype() == opt.dtype ? t : tensor_convert_host(t, opt.dtype)});
  if (opt.fp8_block) {
    std::vector<std::pair<std::string, Tensor>> out;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const std::string& name = tensors[i].first;
      const Tensor& t = tensors[i].second;
      if (fp8_candidate_layer(name) < 0) {
        out.push_back({name, t});
        continue;
      }
      const std::string module = name.substr(0, name.size() - 7);  // without ".weight"
      if (!stored_fp8(name, t, opt, w.config)) {
        kept_linears.push_back(module);
        out.push_back({name, t});
        continue;
      }
      // Quantize the high-precision weight (not its BF16 rounding): the same QuantTensor the
      // FP8 engines build from the master.
      QuantTensor q = quantize_128x128(params[i].second, opt.pow2_scales);
      out.push_back({name, q.data});
      out.push_back({name + "_scale_inv", q.scales});
    }
    tensors = std::move(out);
  }

  // 2. Shards: consecutive tensors up to max_shard_gb each.
  const uint64_t limit = opt.max_shard_gb > 0 ? static_cast<uint64_t>(opt.max_shard_gb * 1e9) : UINT64_MAX;
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  uint64_t cur = 0, total = 0;
  for (auto& nt : tensors) {
    const uint64_t b = nt.second.nbytes();
    if (cur > 0 && cur + b > limit) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(nt);
    cur += b;
    total += b;
  }
  remove_old_weights(dir);
  if (shards.size() == 1) {
    safetensors_write(dir + "/model.safetensors", shards[0], {{"format", "pt"}});
  } else {
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    const size_t n = shards.size();
    for (size_t i = 0; i < n; ++i) {
      char file[64];
      std::snprintf(file, sizeof file, "model-%05zu-of-%05zu.safetensors", i + 1, n);
      safetensors_write(dir + "/" + file, shards[i], {{"format", "pt"}});
      for (const auto& nt : shards[i]) map[nt.first] = file;
    }
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = map;
    write_file_atomic(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
  }

  // 3. config.json: the stored dtype, and the quantization config of the FP8 format.
  ModelConfig c = w.config;
  c.torch_dtype = torch_dtype_name(opt.dtype);
  nlohmann::ordered_json cj = nlohmann::ordered_json::parse(model_config_to_json(c));
  if (opt.fp8_block) {
    std::vector<std::string> not_converted = {"lm_head"};
    not_converted.insert(not_converted.end(), kept_linears.begin(), kept_linears.end());
    for (int l = 0; l < L; ++l)  // MoE routers stay high precision (an nn.Linear in transformers 4)
      if (w.layers[l].is_moe()) not_converted.push_back("model.layers." + std::to_string(l) + ".mlp.gate");
    cj["quantization_config"] = {{"quant_method", "fp8"},
                                 {"fmt", "e4m3"},
                                 {"activation_scheme", "dynamic"},
                                 {"weight_block_size", {kQuantBlock, kQuantBlock}},
                                 {"modules_to_not_convert", not_converted},
                                 {"ignored_layers", not_converted}};
  }
  write_file_atomic(dir + "/config.json", cj.dump(2) + "\n");
}

std::vector<std::string> model_copy_side_files(const std::string& from_dir, const std::string& to_dir) {
  static const char* kFiles[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                 "chat_template.jinja", "generation_config.json", "added_tokens.json",
                                 "vocab.json", "merges.txt", "tokenizer.model"};
  std::vector<std::string> copied;
  std::error_code ec;
  if (from_dir.empty() || sfs::equivalent(from_dir, to_dir, ec)) return copied;
  for (const char* f : kFiles) {
    const std::string src = from_dir + "/" + f;
    if (!sfs::is_regular_file(src)) continue;
    write_file_atomic(to_dir + "/" + f, read_file(src));
    copied.push_back(f);
  }
  return copied;
}

}  // namespace fp8rl
