// Tensor: a typed, contiguous, row-major view of memory owned by a shared Storage.
// Shapes are listed outermost first; every API comment writes them as [dim, dim, ...].
// A Tensor lives on one device; only a Backend allocates device memory (backend/backend.h).
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace fp8rl {

enum class DeviceKind : uint8_t { CPU, CUDA };
const char* device_name(DeviceKind d);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

// Raw memory block. `release` frees it (free() on the CPU, cudaFree on the GPU).
struct Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceKind device = DeviceKind::CPU;
  std::function<void(void*)> release;
  ~Storage();
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialized CPU tensor (64-byte aligned).
  static Tensor empty(const Shape& shape, DType dtype);
  static Tensor zeros(const Shape& shape, DType dtype);
  // Wraps memory owned by `storage` (used by backends and by memory-mapped checkpoints).
  Tensor(std::shared_ptr<Storage> storage, size_t offset_bytes, Shape shape, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  DeviceKind device() const { return storage_ ? storage_->device : DeviceKind::CPU; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const;  // negative i counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  void* raw() const;
  template <class T>
  T* data() const { return static_cast<T*>(raw()); }

  // Same memory, new shape with the same number of elements.
  Tensor reshape(const Shape& shape) const;
  // Rows [begin, end) of the outermost dimension (shares memory).
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // Element i of the outermost dimension, with that dimension dropped (shares memory).
  Tensor select(int64_t i) const;

  const std::shared_ptr<Storage>& storage() const { return storage_; }
  size_t offset_bytes() const { return offset_; }
  std::string str() const;  // "F32[4, 128] on cpu"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::F32;
};

// Throws a clear error unless `t` has this dtype / shape (`what` names the argument).
void check_dtype(const Tensor& t, DType dtype, const char* what);
void check_shape(const Tensor& t, const Shape& shape, const char* what);

// CPU-only helpers for tests and references: the values as float (any float dtype) and back.
std::vector<float> to_float_vector(const Tensor& t);
Tensor from_float_vector(const std::vector<float>& v, const Shape& shape, DType dtype = DType::F32);

}  // namespace fp8rl
