// fp8rl export --model DIR --out DIR [--format fp8-block|bf16|f32] [--pow2-scales]
//              [--bf16-first-layers N] [--bf16-last-layers M] [--max-shard-gb X]
// Writes a Hugging Face checkpoint of a model: BF16 or F32 weights, or the FP8 block format
// that transformers (FineGrainedFP8) and vLLM load directly (model/weights.h SaveOptions). The
// tokenizer files and generation_config.json of the source directory are copied beside it.
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "core/error.h"
#include "model/weights.h"

namespace fp8rl::cli {
namespace {

constexpr const char* kUsage =
    "usage: fp8rl export --model DIR --out DIR [--format fp8-block|bf16|f32] [--pow2-scales]\n"
    "                    [--bf16-first-layers N] [--bf16-last-layers M] [--max-shard-gb X]\n"
    "  fp8-block: the 7 linears of each block as F8_E4M3 + weight_scale_inv (128x128 blocks),\n"
    "             everything else BF16, config.json with quantization_config (transformers, vLLM)\n"
    "  bf16 (default) / f32: plain weights in that dtype\n"
    "  --max-shard-gb: shard above this size with model.safetensors.index.json (default 5)\n";

int run(const std::vector<std::string>& argv) {
  Args a(argv, {"model", "out", "format", "bf16-first-layers", "bf16-last-layers", "max-shard-gb"},
         {"pow2-scales", "help"});
  if (a.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  const std::string src = a.require("model"), out = a.require("out");
  const std::string format = a.get("format", "bf16");
  SaveOptions opt;
  if (format == "fp8-block") {
    opt.fp8_block = true;
    opt.dtype = DType::BF16;
  } else if (format == "bf16" || format == "f32") {
    opt.dtype = format == "bf16" ? DType::BF16 : DType::F32;
  } else {
    throw Error("--format must be fp8-block, bf16 or f32, got '" + format + "'");
  }
  if (!opt.fp8_block && (a.has("pow2-scales") || a.has("bf16-first-layers") || a.has("bf16-last-layers")))
    throw Error("--pow2-scales / --bf16-first-layers / --bf16-last-layers apply to --format fp8-block only");
  opt.pow2_scales = a.has("pow2-scales");
  opt.bf16_first_layers = a.get_int("bf16-first-layers", 0, 0);
  opt.bf16_last_layers = a.get_int("bf16-last-layers", 0, 0);
  const std::string shard = a.get("max-shard-gb", "5");
  try {
    size_t used = 0;
    opt.max_shard_gb = std::stod(shard, &used);
    if (used != shard.size()) throw std::invalid_argument(shard);
  } catch (const std::exception&) {
    throw Error("--max-shard-gb: '" + shard + "' is not a number");
  }
  std::error_code ec;
  if (std::filesystem::exists(out) && std::filesystem::equivalent(src, out, ec))
    throw Error("--out must differ from --model (export writes a new directory)");

  const ModelWeights w = model_weights_load(src, DType::F32);
  model_weights_save(w, out, opt);
  const std::vector<std::string> copied = model_copy_side_files(src, out);
  std::printf("exported %s -> %s (%s, %lld parameters%s)\n", src.c_str(), out.c_str(), format.c_str(),
              static_cast<long long>(model_count_parameters(w)), copied.empty() ? "; no tokenizer files to copy" : "");
  const std::vector<std::string> misread = model_fp8_hf_dequantize_misreads(w, opt);
  if (!misread.empty()) {  // docs/benchmarks.md, "FP8-block export loaded by transformers"
    std::fprintf(stderr,
                 "note: %zu FP8 linear(s) have a width that is not a multiple of 128 (partial scale blocks). vLLM and "
                 "transformers' FP8 kernels read them right; transformers' dequantize=True load (FineGrainedFP8Config("
                 "dequantize=True), and its automatic fallback on a CPU or a GPU below sm_89) derives the block size "
                 "from the scale grid and does not:\n",
                 misread.size());
    for (size_t i = 0; i < misread.size() && i < 8; ++i) std::fprintf(stderr, "  %s\n", misread[i].c_str());
    if (misread.size() > 8) std::fprintf(stderr, "  ... and %zu more\n", misread.size() - 8);
  }
  return 0;
}

Register reg{"export", "write a model as a HF checkpoint: bf16, f32 or the FP8 block format (vLLM/transformers)", run};

}  // namespace
}  // namespace fp8rl::cli
