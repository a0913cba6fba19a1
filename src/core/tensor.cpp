#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/error.h"

namespace fp8rl {

const char* device_name(DeviceKind d) { return d == DeviceKind::CPU ? "cpu" : "cuda"; }

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Storage::~Storage() {
  if (ptr && release) release(ptr);
}

Tensor::Tensor(std::shared_ptr<Storage> storage, size_t offset_bytes, Shape shape, DType dtype)
    : storage_(std::move(storage)), offset_(offset_bytes), shape_(std::move(shape)), dtype_(dtype) {
  for (int64_t d : shape_) FP8RL_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape_));
  FP8RL_CHECK(!storage_ || offset_ + nbytes() <= storage_->bytes, "tensor ", shape_str(shape_),
              " does not fit its storage");
}

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  auto st = std::make_shared<Storage>();
  const size_t alloc = ((bytes + 63) / 64) * 64;
  st->ptr = alloc ? std::aligned_alloc(64, alloc) : nullptr;
  FP8RL_CHECK(alloc == 0 || st->ptr, "out of host memory allocating ", bytes, " bytes");
  st->bytes = bytes;
  st->device = DeviceKind::CPU;
  st->release = [](void* p) { std::free(p); };
  return Tensor(st, 0, shape, dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  if (t.nbytes()) std::memset(t.raw(), 0, t.nbytes());
  return t;
}

int64_t Tensor::dim(int i) const {
  const int n = ndim();
  if (i < 0) i += n;
  FP8RL_CHECK(i >= 0 && i < n, "dimension ", i, " out of range for shape ", shape_str(shape_));
  return shape_[i];
}

void* Tensor::raw() const {
  if (!storage_) return nullptr;
  return static_cast<char*>(storage_->ptr) + offset_;
}

Tensor Tensor::reshape(const Shape& shape) const {
  FP8RL_CHECK(shape_numel(shape) == numel(), "cannot reshape ", shape_str(shape_), " to ",
              shape_str(shape));
  return Tensor(storage_, offset_, shape, dtype_);
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  FP8RL_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "bad row slice [",
              begin, ", ", end, ") of ", shape_str(shape_));
  Shape s = shape_;
  s[0] = end - begin;
  const size_t row_bytes = static_cast<size_t>(shape_numel(Shape(shape_.begin() + 1, shape_.end()))) *
                           dtype_size(dtype_);
  return Tensor(storage_, offset_ + static_cast<size_t>(begin) * row_bytes, s, dtype_);
}

Tensor Tensor::select(int64_t i) const {
  Tensor r = slice_rows(i, i + 1);
  return r.reshape(Shape(shape_.begin() + 1, shape_.end()));
}

std::string Tensor::str() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " on " + device_name(device());
}

void check_dtype(const Tensor& t, DType dtype, const char* what) {
  FP8RL_CHECK(t.dtype() == dtype, what, " must be ", dtype_name(dtype), ", got ", t.str());
}

void check_shape(const Tensor& t, const Shape& shape, const char* what) {
  FP8RL_CHECK(t.shape() == shape, what, " must have shape ", shape_str(shape), ", got ", t.str());
}

std::vector<float> to_float_vector(const Tensor& t) {
  FP8RL_CHECK(t.device() == DeviceKind::CPU, "to_float_vector needs a CPU tensor, got ", t.str());
  const int64_t n = t.numel();
  std::vector<float> out(n);
  switch (t.dtype()) {
    case DType::F32: if (n > 0) std::memcpy(out.data(), t.raw(), n * 4); break;  // (empty: no null memcpy)
    case DType::F64: for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(t.data<double>()[i]); break;
    case DType::BF16: for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(t.data<uint16_t>()[i]); break;
    case DType::F16: for (int64_t i = 0; i < n; ++i) out[i] = f16_to_float(t.data<uint16_t>()[i]); break;
    case DType::E4M3: for (int64_t i = 0; i < n; ++i) out[i] = e4m3_to_float(t.data<uint8_t>()[i]); break;
    default: FP8RL_FAIL("to_float_vector: unsupported dtype ", dtype_name(t.dtype()));
  }
  return out;
}

Tensor from_float_vector(const std::vector<float>& v, const Shape& shape, DType dtype) {
  FP8RL_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape), "from_float_vector: ", v.size(),
              " values for shape ", shape_str(shape));
  Tensor t = Tensor::empty(shape, dtype);
  const size_t n = v.size();
  switch (dtype) {
    case DType::F32: if (n > 0) std::memcpy(t.raw(), v.data(), n * 4); break;
    case DType::F64: for (size_t i = 0; i < n; ++i) t.data<double>()[i] = v[i]; break;
    case DType::BF16: for (size_t i = 0; i < n; ++i) t.data<uint16_t>()[i] = bf16_from_float(v[i]); break;
    case DType::F16: for (size_t i = 0; i < n; ++i) t.data<uint16_t>()[i] = f16_from_float(v[i]); break;
    case DType::E4M3: for (size_t i = 0; i < n; ++i) t.data<uint8_t>()[i] = e4m3_from_float(v[i]); break;
    default: FP8RL_FAIL("from_float_vector: unsupported dtype ", dtype_name(dtype));
  }
  return t;
}

}  // namespace fp8rl
