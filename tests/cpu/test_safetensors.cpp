// safetensors: round trip of every dtype, atomic writes, the broken-file corpus, unaligned
// data, sharded checkpoints and FP8 (E4M3 + scale_inv) weights.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "io/safetensors.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;

// A fresh empty directory per test, removed afterwards.
struct TempDir {
  fs::path path;
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = fs::temp_directory_path() /
           (std::string("fp8rl_st_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// A tensor filled with random bytes (every bit pattern is a valid stored value).
Tensor random_tensor(const Shape& shape, DType dtype, uint32_t seed) {
  Tensor t = Tensor::empty(shape, dtype);
  std::mt19937 rng(seed);
  auto* p = static_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string with_length(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((static_cast<uint64_t>(header.size()) >> (8 * i)) & 0xff);
  return out + header + data;
}

TEST(Safetensors, RoundTripEveryDtype) {
  TempDir dir;
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16, DType::E4M3,
                          DType::I32, DType::I64,  DType::U8,  DType::F64};
  std::vector<std::pair<std::string, Tensor>> tensors;
  uint32_t seed = 1;
  for (DType dt : dtypes) {
    const std::string n = dtype_name(dt);
    tensors.emplace_back(n + ".matrix", random_tensor({3, 5}, dt, seed++));
    tensors.emplace_back(n + ".cube", random_tensor({2, 3, 7}, dt, seed++));
    tensors.emplace_back(n + ".scalar", random_tensor({}, dt, seed++));
    tensors.emplace_back(n + ".empty", random_tensor({0, 4}, dt, seed++));
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "17"}};
  const std::string path = dir.file("all.safetensors");
  safetensors_write(path, tensors, meta);

  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.tensor_names().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(f.contains(name)) << name;
    Tensor r = f.get(name);
    EXPECT_TRUE(same_bytes(t, r)) << name << ": wrote " << t.str() << ", read " << r.str();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r.raw()) % dtype_size(r.dtype()), 0u) << name;
  }
  // No temporary file is left behind.
  for (const auto& e : fs::directory_iterator(dir.path))
    EXPECT_EQ(e.path().filename(), "all.safetensors");
}

TEST(Safetensors, WrittenHeaderIsPaddedAndContiguous) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  safetensors_write(path, {{"b", random_tensor({3}, DType::U8, 5)}, {"a", random_tensor({2, 2}, DType::F32, 6)}});
  const std::string bytes = read_bytes(path);
  SafetensorsHeader h = safetensors_parse_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
  EXPECT_EQ(h.data_start % 8, 0u);
  ASSERT_EQ(h.entries.size(), 2u);
  EXPECT_EQ(h.entries[0].name, "a");  // larger element size first
  EXPECT_EQ(h.entries[0].begin, 0u);
  EXPECT_EQ(h.entries[1].begin, h.entries[0].end);
  EXPECT_EQ(h.data_start + h.entries[1].end, bytes.size());
}

TEST(Safetensors, OverwriteIsAtomicAndFailuresLeaveNoFile) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  Tensor a = random_tensor({4, 4}, DType::F32, 7);
  safetensors_write(path, {{"w", a}});
  Tensor b = random_tensor({4, 4}, DType::F32, 8);
  safetensors_write(path, {{"w", b}});
  EXPECT_TRUE(same_bytes(SafetensorsFile::open(path).get("w"), b));

  // Invalid input: rejected before anything is written; the old file survives.
  EXPECT_THROW(safetensors_write(path, {{"w", a}, {"w", b}}), Error);
  EXPECT_THROW(safetensors_write(path, {{"__metadata__", a}}), Error);
  EXPECT_THROW(safetensors_write(path, {{"u", Tensor()}}), Error);
  EXPECT_TRUE(same_bytes(SafetensorsFile::open(path).get("w"), b));

  // Unwritable destination: an error, and neither the file nor a temporary appears.
  const std::string missing = dir.file("no_such_dir/w.safetensors");
  EXPECT_THROW(safetensors_write(missing, {{"w", a}}), Error);
  EXPECT_FALSE(fs::exists(missing));
  int n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path)) ++n;
  EXPECT_EQ(n, 1);
}

TEST(Safetensors, WritingToALoadedTensorDoesNotTouchTheFile) {
  TempDir dir;
  const std::string path = dir.file("cow.safetensors");
  Tensor a = random_tensor({8}, DType::F32, 9);
  safetensors_write(path, {{"w", a}});
  const std::string before = read_bytes(path);
  {
    Tensor r = SafetensorsFile::open(path).get("w");  // the file object is gone, the mapping lives
    for (int i = 0; i < 8; ++i) r.data<float>()[i] = 1.0f + i;
    EXPECT_EQ(r.data<float>()[7], 8.0f);
  }
  EXPECT_EQ(read_bytes(path), before);
}

TEST(Safetensors, UnalignedDataIsCopied) {
  TempDir dir;
  // Header of 61 bytes (not a multiple of 4): the F32 data starts at file offset 69.
  std::string header = R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  header.append(61 - header.size(), ' ');
  const float vals[3] = {1.5f, -2.25f, 3e-5f};
  std::string data(reinterpret_cast<const char*>(vals), 12);
  const std::string path = dir.file("unaligned.safetensors");
  write_bytes(path, with_length(header, data));
  Tensor t = SafetensorsFile::open(path).get("x");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 4, 0u);
  EXPECT_EQ(to_float_vector(t), std::vector<float>(vals, vals + 3));
}

TEST(Safetensors, GapsAreAllowedAndTrailingBytesIgnored) {
  TempDir dir;
  const std::string header = R"({"x":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})";
  const std::string path = dir.file("gap.safetensors");
  write_bytes(path, with_length(header, std::string("\x01\x02\x03\x04\x05\x06\x07", 7)));
  Tensor t = SafetensorsFile::open(path).get("x");
  EXPECT_EQ(t.data<uint8_t>()[0], 5);
  EXPECT_EQ(t.data<uint8_t>()[1], 6);
}

TEST(Safetensors, EveryBrokenFileIsAnError) {
  const fs::path dir = fs::path(FP8RL_TEST_DATA) / "broken_safetensors";
  int count = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    ++count;
    const std::string path = e.path().string();
    SCOPED_TRACE(path);
    try {
      SafetensorsFile::open(path);
      ADD_FAILURE() << "opened without error";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(e.path().filename().string()), std::string::npos)
          << "message does not name the file: " << err.what();
    }
    const std::string bytes = read_bytes(path);
    EXPECT_THROW(safetensors_parse_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path),
                 Error);
  }
  EXPECT_GE(count, 30) << "the corpus is missing; run scripts/fixtures/make_broken_safetensors.py";
  // The valid seed in the same folder opens.
  SafetensorsFile ok = SafetensorsFile::open((dir / "valid_small.safetensors.ok").string());
  EXPECT_EQ(ok.tensor_names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(ok.get("b").shape(), (Shape{2, 2}));
}

TEST(Safetensors, EveryTruncationOfAValidFileIsAnError) {
  TempDir dir;
  const std::string path = dir.file("v.safetensors");
  safetensors_write(path, {{"a", random_tensor({5}, DType::F32, 3)}, {"b", random_tensor({3}, DType::BF16, 4)}},
                    {{"k", "v"}});
  const std::string bytes = read_bytes(path);
  for (size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(safetensors_parse_header(reinterpret_cast<const uint8_t*>(bytes.data()), n, "t"), Error) << n;
  EXPECT_NO_THROW(safetensors_parse_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "t"));
}

TEST(Safetensors, MissingTensorAndMissingFileAreErrors) {
  TempDir dir;
  EXPECT_THROW(SafetensorsFile::open(dir.file("nope.safetensors")), Error);
  const std::string path = dir.file("one.safetensors");
  safetensors_write(path, {{"a", random_tensor({2}, DType::F32, 1)}});
  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_THROW(f.get("b"), Error);
  EXPECT_THROW(SafetensorsFile::open(dir.path.string()), Error);  // a directory
}

// ---- CheckpointReader -----------------------------------------------------

void write_index(const std::string& path, const std::string& weight_map_json) {
  write_bytes(path, R"({"metadata": {"total_size": 123}, "weight_map": )" + weight_map_json + "}");
}

TEST(Checkpoint, ShardedDirectoryMergesShards) {
  TempDir dir;
  Tensor a = random_tensor({4, 3}, DType::BF16, 11), b = random_tensor({2}, DType::F32, 12);
  Tensor c = random_tensor({6}, DType::I64, 13);
  safetensors_write(dir.file("model-00001-of-00002.safetensors"), {{"a", a}, {"b", b}});
  safetensors_write(dir.file("model-00002-of-00002.safetensors"), {{"c", c}});
  write_index(dir.file("model.safetensors.index.json"),
              R"({"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"})");
  CheckpointReader r = CheckpointReader::open(dir.path.string());
  EXPECT_EQ(r.tensor_names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(same_bytes(r.get("a"), a));
  EXPECT_TRUE(same_bytes(r.get("b"), b));
  EXPECT_TRUE(same_bytes(r.get("c"), c));
  EXPECT_EQ(r.metadata().at("total_size"), "123");
  EXPECT_THROW(r.get("d"), Error);
}

TEST(Checkpoint, SingleFileDirectoryAndPlainFile) {
  TempDir dir;
  Tensor a = random_tensor({3, 3}, DType::F16, 21);
  safetensors_write(dir.file("model.safetensors"), {{"a", a}});
  EXPECT_TRUE(same_bytes(CheckpointReader::open(dir.path.string()).get("a"), a));
  EXPECT_TRUE(same_bytes(CheckpointReader::open(dir.file("model.safetensors")).get("a"), a));
}

TEST(Checkpoint, BadIndexesAreErrors) {
  TempDir dir;
  safetensors_write(dir.file("s1.safetensors"), {{"a", random_tensor({2}, DType::F32, 1)}});
  safetensors_write(dir.file("s2.safetensors"), {{"a", random_tensor({2}, DType::F32, 2)},
                                                 {"b", random_tensor({2}, DType::F32, 3)}});
  const std::string idx = dir.file("model.safetensors.index.json");
  const std::string d = dir.path.string();
  write_index(idx, R"({"a": "s1.safetensors", "b": "s1.safetensors"})");  // b is not in s1
  EXPECT_THROW(CheckpointReader::open(d), Error);
  write_index(idx, R"({"a": "s1.safetensors", "b": "s2.safetensors"})");  // a is in both shards
  EXPECT_THROW(CheckpointReader::open(d), Error);
  write_index(idx, R"({"a": "missing.safetensors"})");
  EXPECT_THROW(CheckpointReader::open(d), Error);
  write_index(idx, R"({"a": "../s1.safetensors"})");
  EXPECT_THROW(CheckpointReader::open(d), Error);
  write_index(idx, R"({"a": 3})");
  EXPECT_THROW(CheckpointReader::open(d), Error);
  write_bytes(idx, "{not json");
  EXPECT_THROW(CheckpointReader::open(d), Error);
  fs::remove(idx);
  EXPECT_THROW(CheckpointReader::open(d), Error);  // neither index nor model.safetensors
  EXPECT_THROW(CheckpointReader::open(dir.file("nothing_here")), Error);
}

TEST(Checkpoint, Fp8WeightWithBlockScales) {
  TempDir dir;
  // W [200, 300]: a 2 x 3 grid of 128x128 blocks, partial blocks at the edges.
  const int64_t n = 200, k = 300;
  std::vector<float> w(n * k);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 100.0f);
  for (float& x : w) x = nd(rng);
  Tensor wq = from_float_vector(w, {n, k}, DType::E4M3);
  Tensor s = from_float_vector({0.5f, 0.25f, 2.0f, 1.0f, 0.125f, 4.0f}, {2, 3});
  Tensor s_np2 = from_float_vector({0.5f, 0.3f, 2.0f, 1.0f, 0.125f, 4.0f}, {2, 3});
  Tensor bias = random_tensor({n}, DType::BF16, 6);
  safetensors_write(dir.file("model.safetensors"), {{"l.weight", wq}, {"l.weight_scale_inv", s},
                                                    {"m.weight", wq}, {"m.weight_scale_inv", s_np2},
                                                    {"l.bias", bias}});
  CheckpointReader r = CheckpointReader::open(dir.path.string());
  EXPECT_TRUE(r.is_quantized("l.weight"));
  EXPECT_FALSE(r.is_quantized("l.bias"));
  QuantTensor q = r.get_quant("l.weight");
  EXPECT_TRUE(same_bytes(q.data, wq));
  EXPECT_EQ(to_float_vector(q.scales), to_float_vector(s));
  EXPECT_EQ(q.block_rows, 128);
  EXPECT_EQ(q.block_cols, 128);
  EXPECT_TRUE(q.pow2);
  EXPECT_FALSE(r.get_quant("m.weight").pow2);
  EXPECT_THROW(r.get_quant("l.bias"), Error);  // not E4M3
}

TEST(Checkpoint, Fp8ScaleErrors) {
  TempDir dir;
  Tensor wq = from_float_vector(std::vector<float>(130 * 10, 3.0f), {130, 10}, DType::E4M3);
  safetensors_write(dir.file("model.safetensors"),
                    {{"nos.weight", wq},
                     {"shape.weight", wq}, {"shape.weight_scale_inv", from_float_vector({1.0f}, {1, 1})},
                     {"neg.weight", wq}, {"neg.weight_scale_inv", from_float_vector({1.0f, -1.0f}, {2, 1})},
                     {"nan.weight", wq}, {"nan.weight_scale_inv", from_float_vector({NAN, 1.0f}, {2, 1})},
                     {"int.weight", wq}, {"int.weight_scale_inv", random_tensor({2, 1}, DType::I32, 1)},
                     {"ok.weight", wq}, {"ok.weight_scale_inv", from_float_vector({1.0f, 3.0f}, {2, 1}, DType::BF16)}});
  CheckpointReader r = CheckpointReader::open(dir.path.string());
  for (const char* name : {"nos.weight", "shape.weight", "neg.weight", "nan.weight", "int.weight"})
    EXPECT_THROW(r.get_quant(name), Error) << name;
  QuantTensor ok = r.get_quant("ok.weight");
  EXPECT_EQ(ok.scales.dtype(), DType::F32);
  EXPECT_EQ(to_float_vector(ok.scales), (std::vector<float>{1.0f, 3.0f}));
  EXPECT_FALSE(ok.pow2);
}

}  // namespace
}  // namespace fp8rl
