// fp8rl logprobs: the log-probability of each token of one sequence under a checkpoint.
//
//   fp8rl logprobs --model DIR --ids "ID ID ..." [--precision fp32|bf16|fp8] [--pow2-scales]
//                  [--device cpu|cuda]
//
// Prints ONE line: for every token from the second on, log p(token | the tokens before it),
// space-separated, %.9g. Precision applies to the 7 linears of every block (q, k, v, o, gate,
// up, down): fp32 = operands as they are; bf16 = both operands rounded to BF16, FP32
// accumulation; fp8 = the block-scaled FP8 recipe (activations 1x128, weights 128x128, E4M3,
// FP32 accumulation; --pow2-scales rounds the scales up to powers of two). Everything else
// (embedding, RMSNorm, RoPE, attention, SwiGLU, lm_head, log-softmax) is FP32, on the CPU and
// on CUDA alike: this command is the reference check against HF, so the CUDA backend is made
// with F32 activations (make_backend(device, F32)), not the BF16 of the training fast path.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "backend/backend.h"
#include "cli/commands.h"
#include "core/error.h"
#include "model/config.h"
#include "model/transformer.h"
#include "model/weights.h"

namespace fp8rl::cli {
namespace {

constexpr const char* kUsage =
    "usage: fp8rl logprobs --model DIR --ids \"ID ID ...\" [--precision fp32|bf16|fp8] [--pow2-scales]\n"
    "                      [--device cpu|cuda]\n"
    "Prints the log-probability of each token from the second on, given the tokens before it.\n";

std::vector<int32_t> parse_ids(const std::string& text, int vocab_size, int max_positions) {
  std::vector<int32_t> ids;
  std::string s = text;
  for (char& ch : s)
    if (ch == ',') ch = ' ';
  std::istringstream in(s);
  std::string word;
  while (in >> word) {
    FP8RL_CHECK(static_cast<int64_t>(ids.size()) < max_positions, "--ids: more than the model's ",
                "max_position_embeddings (", max_positions, ") ids; score a shorter sequence");
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    FP8RL_CHECK(end && *end == '\0' && errno == 0, "--ids: '", word, "' is not an integer token id");
    FP8RL_CHECK(v >= 0 && v < vocab_size, "--ids: token id ", v, " is out of the model's vocabulary [0, ",
                vocab_size, ")");
    ids.push_back(static_cast<int32_t>(v));
  }
  FP8RL_CHECK(ids.size() >= 2, "--ids needs at least 2 token ids (the first has no log-probability), got ",
              ids.size());
  return ids;
}

int run_logprobs(const std::vector<std::string>& argv) {
  const Args args(argv, {"model", "ids", "precision", "device"}, {"pow2-scales", "help"});
  if (args.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  FP8RL_CHECK(args.positional().empty(), "unexpected argument '", args.positional().front(), "'\n", kUsage);
  const std::string dir = args.require("model");
  const ModelConfig config = model_config_load(dir);
  const std::vector<int32_t> ids = parse_ids(args.require("ids"), config.vocab_size, config.max_position_embeddings);

  EnginePrecision precision;
  precision.linear = linear_mode_from_name(args.get("precision", "fp32"));
  precision.pow2_scales = args.has("pow2-scales");

  std::unique_ptr<Backend> backend = make_backend(args.get("device", "cpu"), DType::F32);
  const ModelWeights host = model_weights_load(dir, DType::F32);
  const ModelWeights weights = model_weights_to_device(*backend, host, DType::F32);

  const ForwardBatch batch = forward_batch_from_sequences({ids});
  const LogprobResult r = model_forward_logprobs(*backend, weights, precision, batch, ForwardOptions{});
  const std::vector<float> logp = to_float_vector(backend->to_host(r.logp));
  std::string line;
  char buf[32];
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    std::snprintf(buf, sizeof buf, "%s%.9g", t ? " " : "", static_cast<double>(logp[t]));
    line += buf;
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

const Register kRegister{"logprobs", "per-token log-probabilities of a sequence under a checkpoint",
                         run_logprobs};

}  // namespace
}  // namespace fp8rl::cli
