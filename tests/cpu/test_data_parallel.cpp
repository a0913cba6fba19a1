// Data parallelism (issue 19): the TCP communicator's collectives and its errors (mismatched
// world sizes, a rank that dies, a timeout, disagreeing collectives), with ranks as threads on
// loopback; and `fp8rl train` on 1, 2 and 4 ranks — processes launched here with the
// torchrun-style variables, and with mpirun when it is installed — giving the same metrics and
// final weights for the same global batch. Bounded: every wait has a timeout, every child a
// deadline.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/fs.h"
#include "dist/comm.h"
#include "io/safetensors.h"
#include "support/test_support.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;

// A port that was free a moment ago (the kernel's pick for port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = 0;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

// Runs fn(rank, comm) on `world` threads, each with its own TCP communicator; returns each
// rank's error message ("" when it finished).
std::vector<std::string> run_ranks(int world, double timeout_s,
                                   const std::function<void(int, Communicator&)>& fn,
                                   std::function<int(int)> world_of = nullptr) {
  const int port = free_port();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = comm_tcp_open(r, world_of ? world_of(r) : world, r, "127.0.0.1", port, timeout_s);
        fn(r, *comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(empty error)";
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

TEST(Comm, SingleRankIsTheIdentity) {
  auto c = comm_single_open();
  EXPECT_EQ(c->world_size(), 1);
  float x[2] = {1.5f, -2.0f};
  c->all_reduce(x, 2, ReduceOp::Sum);
  EXPECT_EQ(x[0], 1.5f);
  std::vector<int> v = {1, 2, 3};
  EXPECT_EQ(dist_all_gather_v(*c, v), v);
}

TEST(Comm, TcpCollectivesAgreeOnEveryRank) {
  const int W = 3;
  const auto errors = run_ranks(W, 20, [&](int r, Communicator& c) {
    ASSERT_EQ(c.rank(), r);
    ASSERT_EQ(c.world_size(), W);
    float f[3] = {1.0f * r, 0.5f, -1.0f * r};
    c.all_reduce(f, 3, ReduceOp::Sum);
    EXPECT_EQ(f[0], 3.0f);
    EXPECT_EQ(f[1], 1.5f);
    EXPECT_EQ(f[2], -3.0f);
    double d[2] = {0.25 * r, -1.0 * r};
    c.all_reduce(d, 2, ReduceOp::Max);
    EXPECT_EQ(d[0], 0.5);
    EXPECT_EQ(d[1], 0.0);
    int64_t i = 10 + r;
    c.all_reduce(&i, 1, ReduceOp::Min);
    EXPECT_EQ(i, 10);
    int32_t mine = 100 + r, all[W] = {};
    c.all_gather(&mine, all, sizeof mine);
    for (int k = 0; k < W; ++k) EXPECT_EQ(all[k], 100 + k);
    for (int root = 0; root < W; ++root) {
      int64_t b = r == root ? 7 * (root + 1) : -1;
      c.broadcast(&b, sizeof b, root);
      EXPECT_EQ(b, 7 * (root + 1));
    }
    std::vector<float> in(2 * W), out(2);
    for (int k = 0; k < 2 * W; ++k) in[k] = static_cast<float>(k + r);
    c.reduce_scatter_sum(in.data(), out.data(), 2);
    EXPECT_EQ(out[0], static_cast<float>(3 * (2 * r) + 3));  // sum over ranks q of (2r + q)
    EXPECT_EQ(out[1], static_cast<float>(3 * (2 * r + 1) + 3));
    std::vector<int> v(r, r);  // rank r contributes r copies of r
    EXPECT_EQ(dist_all_gather_v(c, v), (std::vector<int>{1, 2, 2}));
    c.barrier();
  });
  for (int r = 0; r < W; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(Comm, MismatchedWorldSizesFailOnEveryRankNamingBoth) {
  const auto errors = run_ranks(2, 10, [](int, Communicator& c) { c.barrier(); },
                                [](int r) { return r == 0 ? 2 : 3; });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("WORLD_SIZE=3"), std::string::npos) << e;
    EXPECT_NE(e.find("WORLD_SIZE=2"), std::string::npos) << e;
  }
}

TEST(Comm, ARankThatDiesIsNamedByTheOthers) {
  const auto errors = run_ranks(3, 20, [](int r, Communicator& c) {
    c.barrier();
    if (r == 2) throw Error("rank 2 crashed on purpose");  // its communicator closes
    float x = 1;
    c.all_reduce(&x, 1, ReduceOp::Sum);
  });
  EXPECT_NE(errors[0].find("rank 2 closed its connection"), std::string::npos) << errors[0];
  // Rank 0 stops, so rank 1 sees rank 0 go.
  EXPECT_NE(errors[1].find("rank 0 closed its connection"), std::string::npos) << errors[1];
}

TEST(Comm, AStuckRankTimesOut) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto errors = run_ranks(2, 1.0, [](int r, Communicator& c) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // never joins in time
      return;
    }
    float x = 1;
    c.all_reduce(&x, 1, ReduceOp::Sum);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(errors[0].find("timed out after 1 s waiting for rank 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("FP8RL_DIST_TIMEOUT_S"), std::string::npos) << errors[0];
  EXPECT_LT(s, 10.0);
}

TEST(Comm, DisagreeingCollectivesAreCaught) {
  const auto errors = run_ranks(2, 10, [](int r, Communicator& c) {
    std::vector<float> x(r == 0 ? 4 : 3, 1.0f);
    c.all_reduce(x.data(), x.size(), ReduceOp::Sum);
  });
  EXPECT_NE(errors[0].find("ranks disagree on the collective: rank 1 called all_reduce(f32) of 12 bytes"),
            std::string::npos)
      << errors[0];
}

TEST(Comm, EnvironmentErrorsAreWordedForTheUser) {
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "5", 1);
  try {
    dist_env_read();
    ADD_FAILURE() << "RANK >= WORLD_SIZE accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK=5 is not below WORLD_SIZE=2"), std::string::npos) << e.what();
  }
  ::setenv("RANK", "1", 1);
  ::unsetenv("MASTER_PORT");
  try {
    dist_open(dist_env_read());
    ADD_FAILURE() << "no MASTER_PORT accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR and MASTER_PORT"), std::string::npos) << e.what();
  }
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  dist_set_log_prefix(0, 1);
}

// ---- fp8rl train on several ranks ----------------------------------------------------

using test::Scratch;  // the test binary's scratch directory (tests/support/test_support.h)

// The tiny demo run: 4 prompts x 8 samples, 3 GRPO steps of 2 optimizer steps each, from a
// 200-step SFT policy (about 2 s, once per test process); seed 3 earns rewards (a gradient) in
// steps 1 and 2 with fp8_e2e and in all three with bf16.
std::vector<std::string> tiny_args(const std::string& out, const std::string& recipe) {
  return {FP8RL_BINARY, "train", "--out", out, "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
          "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.head_dim=16",
          "model.tiny.intermediate_size=64", "rollout.prompts_per_step=4", "rollout.generations_per_prompt=8",
          "rollout.max_new_tokens=6", "val_every=0", "sft.steps=200", "sft.batch_size=8",
          "train.optimizer_steps_per_rollout=2", "train.lr=3e-3", "steps=3", "seed=3",
          "precision.recipe=" + recipe};
}

// Launches `argv` once per rank with `env` (+ RANK etc. when world > 0); waits at most 60 s.
// Returns every process's exit status; logs under out + ".rank<r>.log".
std::vector<int> launch(const std::vector<std::string>& argv_in, const std::string& out, int world,
                        const std::vector<std::pair<std::string, std::string>>& env = {},
                        const std::vector<std::string>& last_rank_extra = {}) {
  const int port = free_port();
  const int n = world > 0 ? world : 1;
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string log = out + ".rank" + std::to_string(r) + ".log";
      FILE* f = std::freopen(log.c_str(), "w", stdout);
      if (f) ::dup2(::fileno(stdout), 2);
      ::setenv("FP8RL_CACHE_DIR", Scratch::cache().c_str(), 1);
      ::setenv("FP8RL_DIST_TIMEOUT_S", "60", 1);
      ::unsetenv("WORLD_SIZE");
      ::unsetenv("RANK");
      if (world > 0) {
        ::setenv("RANK", std::to_string(r).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
        ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      }
      for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      std::vector<std::string> argv = argv_in;
      if (r == n - 1) argv.insert(argv.end(), last_rank_extra.begin(), last_rank_extra.end());
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> rc(n, -1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int left = n; left > 0;) {
    for (int r = 0; r < n; ++r) {
      if (rc[r] != -1 || pids[r] <= 0) continue;
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        rc[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < n; ++r)
        if (rc[r] == -1) ::kill(pids[r], SIGKILL);
      ADD_FAILURE() << "ranks still running after 60 s; killed";
      for (int r = 0; r < n; ++r)
        if (rc[r] == -1) ::waitpid(pids[r], nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return rc;
}

std::string logs_of(const std::string& out, int n) {
  std::string s;
  for (int r = 0; r < n; ++r) {
    const std::string p = out + ".rank" + std::to_string(r) + ".log";
    if (fs::exists(p)) s += "--- rank " + std::to_string(r) + ":\n" + read_file(p);
  }
  return s;
}

std::vector<nlohmann::json> read_metrics(const std::string& run_dir) {
  std::ifstream f(run_dir + "/metrics.jsonl");
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The F32 master weights and AdamW moments of the run's final checkpoint.
std::map<std::string, std::vector<float>> final_state(const std::string& run_dir) {
  const std::string p = run_dir + "/checkpoints/step_000003/optimizer.safetensors";
  std::map<std::string, std::vector<float>> out;
  if (!fs::exists(p)) return out;
  SafetensorsFile f = SafetensorsFile::open(p);
  for (const std::string& n : f.tensor_names()) out[n] = to_float_vector(f.get(n));
  return out;
}

// Same global batch, W ranks vs one: the metrics of the first `steps` steps, and (when
// `weights`) the final F32 master weights and AdamW moments, equal within `tol` (relative).
// On the CPU backend the sums are bitwise equal today; the tolerance allows another order.
void expect_same_run(const std::string& one, const std::string& many, size_t steps, bool weights, double tol,
                     const std::string& what) {
  SCOPED_TRACE(what);
  const auto a = read_metrics(one), b = read_metrics(many);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), a.size());
  bool learned = false;
  for (size_t i = 0; i < steps; ++i) {
    for (const char* k : {"reward_mean", "accuracy", "response_length_mean", "loss", "grad_norm", "entropy_mean",
                          "token_mult_prob_error", "gen_kl_error", "clip_fraction", "is_weight_mean",
                          "is_weight_max", "kv_scale_k_mean", "kv_scale_v_mean"}) {
      if (!a[i].contains(k)) {
        EXPECT_FALSE(b[i].contains(k)) << k;
        continue;
      }
      ASSERT_TRUE(b[i].contains(k)) << k;
      if (a[i][k].is_null()) {
        EXPECT_TRUE(b[i][k].is_null()) << k << " at step " << i + 1;
        continue;
      }
      const double x = a[i][k].get<double>(), y = b[i][k].get<double>();
      EXPECT_NEAR(x, y, tol * (1 + std::abs(x))) << k << " at step " << i + 1;
    }
    learned |= a[i]["grad_norm"].get<double>() > 0;
  }
  EXPECT_TRUE(learned) << "no step had a gradient: the comparison would be vacuous";
  if (!weights) return;
  const auto wa = final_state(one), wb = final_state(many);
  ASSERT_FALSE(wa.empty());
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, va] : wa) {
    const auto it = wb.find(name);
    ASSERT_NE(it, wb.end()) << name;
    ASSERT_EQ(va.size(), it->second.size()) << name;
    double worst = 0, scale = 0;
    for (size_t i = 0; i < va.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(va[i] - it->second[i])));
      scale = std::max(scale, static_cast<double>(std::abs(va[i])));
    }
    EXPECT_LE(worst, tol * (1 + scale)) << name;
  }
}

std::string run_ranks_ok(const std::string& recipe, int world, const std::vector<std::string>& extra = {},
                         const std::string& tag = "") {
  const std::string out = Scratch::root() + "/" + recipe + "_w" + std::to_string(world) + tag;
  fs::remove_all(out);
  std::vector<std::string> args = tiny_args(out, recipe);
  args.insert(args.end(), extra.begin(), extra.end());
  const auto rc = launch(args, out, world);
  for (size_t r = 0; r < rc.size(); ++r) EXPECT_EQ(rc[r], 0) << "rank " << r << "\n" << logs_of(out, world);
  if (world > 1) {
    EXPECT_NE(read_file(out + ".rank0.log").find("data parallel: " + std::to_string(world) + " ranks (tcp)"),
              std::string::npos);
  }
  return out;
}

// BF16 trainer: splitting a mini-batch across ranks changes only the order of the gradient
// sums, so 2 and 4 ranks (the torchrun-style variables, TCP rendezvous) match one rank on
// every step — rollouts included, since the weights they sample from match — and in the end.
TEST(DataParallel, Bf16OnTwoAndFourRanksMatchesOneRank) {
  const std::string one = run_ranks_ok("bf16", 0);  // no launcher variables: the plain process
  for (int world : {2, 4}) expect_same_run(one, run_ranks_ok("bf16", world), 3, true, 1e-5,
                                           std::to_string(world) + " ranks, bf16");
}

// ZeRO-1 (train.shard_optimizer): each rank keeps and updates only its parameters' moments and
// broadcasts the new weights: the same step, bitwise. The checkpoint holds the full state, so a
// run saved on 4 ranks resumes on one and finishes as the one-rank run does.
TEST(DataParallel, ShardedOptimizerMatchesOneRankAndResumesOnAnotherRankCount) {
  const std::string one = run_ranks_ok("bf16", 0);
  for (int world : {2, 4})
    expect_same_run(one, run_ranks_ok("bf16", world, {"train.shard_optimizer=true"}, "_zero1"), 3, true, 1e-5,
                    std::to_string(world) + " ranks, bf16, ZeRO-1");
  const std::string part = run_ranks_ok("bf16", 4, {"train.shard_optimizer=true", "steps=2"}, "_resume");
  ASSERT_EQ(read_metrics(part).size(), 2u);
  {  // resume the 4-rank run on one rank (logs: part + "_resumed.rank0.log")
    const auto rc = launch([&] {
      std::vector<std::string> a = tiny_args(part, "bf16");
      a.push_back("--resume");
      return a;
    }(), part + "_resumed", 0);
    ASSERT_EQ(rc[0], 0) << logs_of(part + "_resumed", 1);
  }
  expect_same_run(one, part, 3, true, 1e-5, "4 ranks ZeRO-1 for 2 steps, resumed on 1 rank for step 3");
}

// The demo's fp8_e2e recipe. With 2 ranks each mini-batch lies on one rank: equal throughout.
// With 4 ranks two ranks share each mini-batch, and the FP8 trainer's wgrad quantizes its
// operands in blocks along the tokens (128x128 recipe): which tokens share a scale depends on
// the packing, so the gradient differs at FP8-quantization level (as changing
// train.micro_batch_tokens does on one rank) and later rollouts sample differently. Step 1 —
// the same rollout (equal), loss and gradient norm at the FP8 quantization's level (1e-2: one
// E4M3 rounding is up to 6%; with the Gumbel-max draw's rollout the norm differs by 1.4e-3,
// with the former inverse-CDF draw's by < 1e-4) — still matches.
TEST(DataParallel, Fp8OnTwoRanksMatchesOneRankAndFourRanksTheFirstStep) {
  const std::string one = run_ranks_ok("fp8_e2e", 0);
  expect_same_run(one, run_ranks_ok("fp8_e2e", 2), 3, true, 1e-5, "2 ranks, fp8_e2e");
  const std::string four = run_ranks_ok("fp8_e2e", 4);
  expect_same_run(one, four, 1, false, 1e-2, "4 ranks, fp8_e2e, step 1");
  const auto a = read_metrics(one), b = read_metrics(four);
  ASSERT_FALSE(a.empty() || b.empty());
  for (const char* k : {"reward_mean", "response_length_mean", "token_mult_prob_error", "gen_kl_error"})
    EXPECT_EQ(a[0][k], b[0][k]) << k << ": step 1's rollout is the same on 4 ranks";
}

TEST(DataParallel, MpirunMatchesOneRank) {
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not installed (openmpi-bin)";
  if (!comm_mpi_available()) GTEST_SKIP() << "built without MPI (FP8RL_MPI, libopenmpi-dev)";
  const std::string one = run_ranks_ok("bf16", 0);
  const std::string many = Scratch::root() + "/mpi_w2";
  fs::remove_all(many);
  std::string cmd = "exec mpirun --oversubscribe -np 2";
  if (::geteuid() == 0) cmd += " --allow-run-as-root";
  for (const std::string& a : tiny_args(many, "bf16")) cmd += " '" + a + "'";
  // Under the sanitizer pass (scripts/test.sh) Open MPI's own allocations would count as leaks.
  const char* asan = std::getenv("ASAN_OPTIONS");
  const auto rc = launch({"/bin/sh", "-c", cmd}, many, 0,
                         // one node: shared memory between the ranks, loopback for mpirun's own wiring
                         {{"OMPI_MCA_btl", "self,vader"}, {"OMPI_MCA_oob_tcp_if_include", "lo"},
                          {"ASAN_OPTIONS", std::string(asan ? asan : "") + ":detect_leaks=0"}});
  ASSERT_EQ(rc[0], 0) << logs_of(many, 1);
  expect_same_run(one, many, 3, true, 1e-5, "mpirun -np 2, bf16");
  EXPECT_NE(read_file(many + ".rank0.log").find("data parallel: 2 ranks (mpi)"), std::string::npos)
      << logs_of(many, 1);
}

// A rank that fails after the job started (here: a model path that does not exist) stops
// every rank, each naming the rank, within the test's deadline.
TEST(DataParallel, ARankThatFailsStopsTheJob) {
  const std::string out = Scratch::root() + "/dies";
  fs::remove_all(out);
  const auto rc = launch(tiny_args(out, "bf16"), out, 3, {}, {"model.path=/nonexistent/model"});
  for (int r = 0; r < 3; ++r) EXPECT_NE(rc[r], 0) << "rank " << r;
  const std::string log0 = read_file(out + ".rank0.log"), log2 = read_file(out + ".rank2.log");
  EXPECT_NE(log2.find("[rank 2/3] fp8rl train: error:"), std::string::npos) << log2;
  EXPECT_NE(log2.find("/nonexistent/model"), std::string::npos) << log2;
  EXPECT_NE(log0.find("[rank 0/3] fp8rl train: error: rank 2 closed its connection"), std::string::npos) << log0;
}

TEST(DataParallel, MpirunStopsTheJobWhenARankFails) {
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not installed (openmpi-bin)";
  if (!comm_mpi_available()) GTEST_SKIP() << "built without MPI (FP8RL_MPI, libopenmpi-dev)";
  const std::string out = Scratch::root() + "/mpi_dies";
  fs::remove_all(out);
  std::string args;
  for (const std::string& a : tiny_args(out, "bf16")) args += " '" + a + "'";
  std::string cmd = "exec mpirun --oversubscribe";
  if (::geteuid() == 0) cmd += " --allow-run-as-root";
  cmd += " -np 1" + args + " : -np 1" + args + " model.path=/nonexistent/model";  // MPMD: rank 1 differs
  const char* asan = std::getenv("ASAN_OPTIONS");
  const auto rc = launch({"/bin/sh", "-c", cmd}, out, 0,
                         {{"OMPI_MCA_btl", "self,vader"}, {"OMPI_MCA_oob_tcp_if_include", "lo"},
                          {"ASAN_OPTIONS", std::string(asan ? asan : "") + ":detect_leaks=0"}});
  EXPECT_NE(rc[0], 0);
  const std::string log = read_file(out + ".rank0.log");
  EXPECT_NE(log.find("[rank 1/2] fp8rl train: error:"), std::string::npos) << log;
}

TEST(DataParallel, ErrorsNameTheRank) {
  const std::string out = Scratch::root() + "/err";
  fs::remove_all(out);
  std::vector<std::string> args = tiny_args(out, "bf16");
  args.push_back("rollout.prompts_per_step=1");  // fewer prompts than ranks
  const auto rc = launch(args, out, 2);
  for (int r = 0; r < 2; ++r) EXPECT_NE(rc[r], 0);
  const std::string log1 = read_file(out + ".rank1.log");
  EXPECT_NE(log1.find("[rank 1/2] fp8rl train: error:"), std::string::npos) << log1;
  EXPECT_NE(log1.find("rollout.prompts_per_step=1 is below the number of ranks (2)"), std::string::npos) << log1;
}

}  // namespace
}  // namespace fp8rl
