// nbmemdev: a PrivateUse1 test device whose "device memory" is host memory.
//
// Built and loaded by tests/_testdevice/__init__.py (which renames PrivateUse1
// to "nbmemdev"). It lets nbmem's measured mode run in CI without a GPU: the
// allocator below keeps real c10::CachingDeviceAllocator::DeviceStats, so
// torch.accelerator.memory_allocated() & co. report real numbers, and it
// enforces a capacity, so OOMs are real torch.OutOfMemoryError exceptions.
//
// Ops run on CPU kernels: a handful of "structural" ops (empty, views, copies,
// resize, set_) are registered here; everything else goes through ATen's boxed
// CPU fallback (inputs copied to CPU, op run, outputs copied back into device
// tensors allocated by our allocator). Modelled on PyTorch's OpenReg backend
// (test/cpp_extensions/open_registration_extension/torch_openreg).
//
// Python talks to it with ctypes (extern "C" functions at the end): no pybind11,
// which keeps the build short.

// ATen/autocast_mode.h brings ATen/ATen.h and ATen/NativeFunctions.h (every
// op's at:: and at::native:: function): most of the ~20 s build, and the price
// of reusing ATen's own autocast op lists (see the end of the file).
#include <ATen/autocast_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace nbmemdev {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::StatType;

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
const c10::Device kDevice(kType, 0);  // the one and only device

// ---------------------------------------------------------------------------
// Allocator
//
// Caching rule (a simplified CUDA caching allocator):
//  * every request is rounded up to a multiple of 512 bytes (at least 512), as
//    CUDA's allocator does; that rounded size is what "allocated" counts, and
//    the unrounded request is what "requested" counts;
//  * a freed block is not returned to the system: it stays cached (reserved)
//    in a free list keyed by its exact rounded size, and is reused by the next
//    request of the same rounded size (no splitting, no merging);
//  * emptyCache() frees all cached blocks; reserved = allocated + cached;
//  * each fresh malloc is one "segment"; a block <= 1 MiB counts in the small
//    pool, larger ones in the large pool (the StatType breakdown);
//  * reserved may not exceed the capacity (default 1 GiB): when it would, the
//    cache is emptied and the request retried, and if it still does not fit,
//    an OutOfMemoryError is thrown (torch.OutOfMemoryError in Python).
// ---------------------------------------------------------------------------

constexpr size_t kRound = 512;
constexpr size_t kSmallSize = 1 << 20;

void deleteBlock(void* ptr);

class Allocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &deleteBlock, kDevice};
    const size_t size = (nbytes + kRound - 1) / kRound * kRound;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto cached = cache_.find(size);
      if (cached != cache_.end() && !cached->second.empty()) {
        ptr = cached->second.back();
        cached->second.pop_back();
        cached_bytes_ -= size;
      } else {
        if (reserved() + size > capacity_) {
          stats_.num_alloc_retries += 1;
          releaseCached();
        }
        if (reserved() + size > capacity_) {
          stats_.num_ooms += 1;
          oom(nbytes);  // throws
        }
        ptr = std::aligned_alloc(64, size);
        TORCH_CHECK_WITH(OutOfMemoryError, ptr, "nbmemdev: host malloc of ", size, " bytes failed");
        update(stats_.reserved_bytes, size, size, true);
        update(stats_.segment, size, 1, true);
        stats_.num_device_alloc += 1;
      }
      live_[ptr] = {size, nbytes};
      update(stats_.allocated_bytes, size, size, true);
      update(stats_.active_bytes, size, size, true);
      update(stats_.requested_bytes, size, nbytes, true);
      update(stats_.allocation, size, 1, true);
      update(stats_.active, size, 1, true);
    }
    return {ptr, ptr, &deleteBlock, kDevice};
  }

  // Called by the DataPtr's deleter: the block goes back to the cache.
  void release(void* ptr) {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = live_.find(ptr);
    TORCH_INTERNAL_ASSERT(found != live_.end(), "nbmemdev: freeing an unknown pointer");
    const auto [size, requested] = found->second;
    live_.erase(found);
    update(stats_.allocated_bytes, size, size, false);
    update(stats_.active_bytes, size, size, false);
    update(stats_.requested_bytes, size, requested, false);
    update(stats_.allocation, size, 1, false);
    update(stats_.active, size, 1, false);
    cache_[size].push_back(ptr);
    cached_bytes_ += size;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &deleteBlock; }
  void copy_data(void* dest, const void* src, size_t count) const override { std::memcpy(dest, src, count); }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t /*pool*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    releaseCached();
  }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // one stream: nothing to track

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    checkDevice(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    checkDevice(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* array : statArrays())
      for (auto& stat : *array) stat.reset_accumulated();
    stats_.num_alloc_retries = stats_.num_ooms = 0;
    stats_.num_device_alloc = stats_.num_device_free = 0;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    checkDevice(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* array : statArrays())
      for (auto& stat : *array) stat.reset_peak();
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    checkDevice(device);
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t used = reserved();
    return {used < capacity_ ? capacity_ - used : 0, capacity_};
  }

  void setCapacity(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    capacity_ = bytes;
  }
  size_t capacity() {
    std::lock_guard<std::mutex> lock(mutex_);
    return capacity_;
  }
  size_t cachedBytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_bytes_;
  }

 private:
  static void checkDevice(c10::DeviceIndex device) {
    TORCH_CHECK(device == 0 || device == -1, "nbmemdev has one device (index 0), not ", int(device));
  }
  size_t reserved() const { return static_cast<size_t>(stats_.reserved_bytes[0].current); }

  // Applies +amount / -amount to the aggregate entry and the block's pool entry.
  static void update(c10::CachingAllocator::StatArray& array, size_t block, size_t amount, bool increase) {
    const auto pool = block <= kSmallSize ? StatType::SMALL_POOL : StatType::LARGE_POOL;
    for (auto type : {StatType::AGGREGATE, pool}) {
      auto& stat = array[static_cast<size_t>(type)];
      increase ? stat.increase(amount) : stat.decrease(amount);
    }
  }
  std::vector<c10::CachingAllocator::StatArray*> statArrays() {
    return {&stats_.allocation, &stats_.segment, &stats_.active, &stats_.inactive_split,
            &stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes,
            &stats_.inactive_split_bytes, &stats_.requested_bytes};
  }
  // Frees every cached block (caller holds the mutex).
  void releaseCached() {
    for (auto& [size, blocks] : cache_) {
      for (void* ptr : blocks) {
        std::free(ptr);
        update(stats_.reserved_bytes, size, size, false);
        update(stats_.segment, size, 1, false);
        stats_.num_device_free += 1;
      }
    }
    cache_.clear();
    cached_bytes_ = 0;
  }
  // Throws the error CUDA's allocator throws, worded the same way.
  [[noreturn]] void oom(size_t nbytes) const {
    const size_t used = reserved();
    const size_t allocated = static_cast<size_t>(stats_.allocated_bytes[0].current);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "nbmemdev out of memory. Tried to allocate ", mib(nbytes),
                     ". Device 0 has a total capacity of ", mib(capacity_), " of which ",
                     mib(used < capacity_ ? capacity_ - used : 0), " is free. Of the allocated memory ",
                     mib(allocated), " is allocated by PyTorch, and ", mib(used - allocated),
                     " is reserved by PyTorch but unallocated.");
    std::abort();  // unreachable
  }
  static std::string mib(size_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f MiB", bytes / 1048576.0);
    return text;
  }

  std::mutex mutex_;
  DeviceStats stats_;
  size_t capacity_ = size_t(1) << 30;
  size_t cached_bytes_ = 0;
  std::unordered_map<size_t, std::vector<void*>> cache_;                  // rounded size -> free blocks
  std::unordered_map<void*, std::pair<size_t, size_t>> live_;            // ptr -> (rounded, requested)
};

// Never destroyed: tensors may be freed during interpreter shutdown, after
// static destructors have run.
Allocator* const g_allocator = new Allocator();
void deleteBlock(void* ptr) { g_allocator->release(ptr); }
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, g_allocator)

// ---------------------------------------------------------------------------
// Device guard: one device (index 0), one default stream, events are no-ops
// (all work is synchronous on the host).
// ---------------------------------------------------------------------------

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  GuardImpl() = default;
  explicit GuardImpl(c10::DeviceType t) { TORCH_CHECK(t == kType); }
  static void check(c10::Device d) {
    TORCH_CHECK(d.type() == kType && (d.index() == 0 || d.index() == -1),
                "nbmemdev has one device (index 0), got ", d);
  }
  static c10::Stream defaultStream() { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override { check(d); return kDevice; }
  c10::Device getDevice() const override { return kDevice; }
  void setDevice(c10::Device d) const override { check(d); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return defaultStream(); }
  c10::Stream getDefaultStream(c10::Device) const override { return defaultStream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return defaultStream(); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override { return defaultStream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return defaultStream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl)

// ---------------------------------------------------------------------------
// Hooks: what at::globalContext() / torch.accelerator ask of PrivateUse1.
// Random numbers come from the CPU generator (ops run on CPU kernels anyway),
// so torch.manual_seed makes device results equal CPU results.
// ---------------------------------------------------------------------------

struct Hooks final : public at::PrivateUse1HooksInterface {
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  void setCurrentDevice(c10::DeviceIndex d) const override { GuardImpl::check({kType, d}); }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override { GuardImpl::check({kType, d}); return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  bool isPinnedPtr(const void*) const override { return false; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  at::Device getDeviceFromPtr(void*) const override { return kDevice; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::make_generator<at::CPUGeneratorImpl>(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);  // host memory: CPU logic applies
  }
};

static bool g_hooks_registered = [] {
  static Hooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return true;
}();

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

// A CPU tensor aliasing a device tensor's memory (same sizes, strides, offset).
at::Tensor asCpu(const at::Tensor& t) {
  if (!t.defined() || t.is_cpu()) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  if (device) GuardImpl::check(*device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "nbmemdev: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "nbmemdev: pin_memory is for CPU tensors");
  return at::detail::empty_generic(size, g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  if (device) GuardImpl::check(*device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "nbmemdev: only strided tensors");
  return at::detail::empty_strided_generic(size, stride, g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<c10::MemoryFormat> format) {
  return at::native::resize_(self, size, format);  // reallocates through the storage's allocator (ours)
}

at::Tensor _reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

// Every copy that touches the device: device<->CPU and device<->device are
// plain CPU copies between aliases (strides and dtype conversion handled).
at::Tensor _copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor target = asCpu(dst);
  at::native::copy_(target, asCpu(self), non_blocking);
  return dst;
}

at::Tensor _copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return nbmemdev::_copy_from(self, dst, false);
}

at::Scalar _local_scalar_dense(const at::Tensor& self) { return at::native::_local_scalar_dense_cpu(asCpu(self)); }

at::Tensor& set_source_Tensor_(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}
at::Tensor& set_source_Storage_(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }
at::Tensor& set_source_Storage_storage_offset_(at::Tensor& self, at::Storage source, int64_t offset,
                                              c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

// In-place fills run directly on the device memory (no round trip).
at::Tensor& fill_(at::Tensor& self, const at::Scalar& value) {
  asCpu(self).fill_(value);
  return self;
}
at::Tensor& zero_(at::Tensor& self) {
  asCpu(self).zero_();
  return self;
}

// Fused RNN cells. For a PrivateUse1 input, ATen's LSTM and GRU call the fused
// cells CUDA has (and CPU lacks): these compute them on CPU aliases, with the
// math of aten/src/ATen/native/cuda/RNN.cu, and allocate on the device only
// the outputs (as the fused kernels do). Gate order: LSTM i,f,g,o; GRU r,i,n.
at::Tensor toDevice(const at::Tensor& t) { return t.defined() ? t.to(kDevice) : t; }
at::Tensor addBias(at::Tensor gates, const std::optional<at::Tensor>& bias) {
  return bias && bias->defined() ? gates.add(asCpu(*bias)) : gates;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell(const at::Tensor& igates, const at::Tensor& hgates,
                                                         const at::Tensor& cx, const std::optional<at::Tensor>& b_ih,
                                                         const std::optional<at::Tensor>& b_hh) {
  auto gates = addBias(addBias(asCpu(igates).add(asCpu(hgates)), b_ih), b_hh).chunk(4, 1);
  auto i = gates[0].sigmoid(), f = gates[1].sigmoid(), g = gates[2].tanh(), o = gates[3].sigmoid();
  auto cy = f.mul(asCpu(cx)).add(i.mul(g));
  auto hy = o.mul(cy.tanh());
  return {toDevice(hy), toDevice(cy), toDevice(at::cat({i, f, g, o}, 1))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy, const at::Tensor& cx,
    const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  auto w = asCpu(workspace).chunk(4, 1);
  auto &i = w[0], &f = w[1], &g = w[2], &o = w[3];
  auto tanh_cy = asCpu(cy).tanh();
  auto ghy = grad_hy && grad_hy->defined() ? asCpu(*grad_hy) : at::zeros_like(tanh_cy);
  auto gc = ghy.mul(o).mul(tanh_cy.square().neg().add(1));  // d/dcy
  if (grad_cy && grad_cy->defined()) gc = gc.add(asCpu(*grad_cy));
  auto gi = gc.mul(g).mul(i.neg().add(1).mul(i));
  auto gf = gc.mul(asCpu(cx)).mul(f.neg().add(1).mul(f));
  auto gg = gc.mul(i).mul(g.square().neg().add(1));
  auto go = ghy.mul(tanh_cy).mul(o.neg().add(1).mul(o));
  auto grad_gates = at::cat({gi, gf, gg, go}, 1);
  auto grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {toDevice(grad_gates), toDevice(gc.mul(f)), toDevice(grad_bias)};
}

std::tuple<at::Tensor, at::Tensor> gru_cell(const at::Tensor& igates, const at::Tensor& hgates, const at::Tensor& hx,
                                            const std::optional<at::Tensor>& b_ih,
                                            const std::optional<at::Tensor>& b_hh) {
  auto in = addBias(asCpu(igates), b_ih).chunk(3, 1), hn = addBias(asCpu(hgates), b_hh).chunk(3, 1);
  auto r = in[0].add(hn[0]).sigmoid(), i = in[1].add(hn[1]).sigmoid();
  auto n = in[2].add(r.mul(hn[2])).tanh();
  auto h = asCpu(hx);
  auto hy = n.add(i.mul(h.sub(n)));
  return {toDevice(hy), toDevice(at::cat({r, i, n, h, hn[2]}, 1))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  auto w = asCpu(workspace).chunk(5, 1);
  auto &r = w[0], &i = w[1], &n = w[2], &h = w[3], &hn = w[4];
  auto ghy = asCpu(grad_hy);
  auto gi = ghy.mul(h.sub(n)).mul(i.neg().add(1).mul(i));
  auto gn = ghy.mul(i.neg().add(1)).mul(n.square().neg().add(1));
  auto gr = gn.mul(hn).mul(r.neg().add(1).mul(r));
  auto grad_input = at::cat({gr, gi, gn}, 1), grad_hidden = at::cat({gr, gi, gn.mul(r)}, 1);
  at::Tensor bias_input, bias_hidden;
  if (has_bias) bias_input = grad_input.sum(0), bias_hidden = grad_hidden.sum(0);
  return {toDevice(grad_input), toDevice(grad_hidden), toDevice(ghy.mul(i)), toDevice(bias_input),
          toDevice(bias_hidden)};
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { at::native::cpu_fallback(op, stack); }

// The fallback's CPU kernels keep their internal temporaries in CPU memory,
// which the device doesn't see. The reduced elementwise losses hold the ones
// that matter in a training step, and CUDA's kernels (the same structured code
// as CPU's) make them: an input-sized temporary for the unreduced loss, and,
// for mse_loss and smooth_l1_loss, an output allocated at the unreduced size
// and resized to a scalar, which keeps its storage (the loss tensor holds
// input-size bytes). Made on the device here; the fallback's own scalar output
// is copied into that output (a 512-byte transient more than CUDA).
// Schema: (self, target, reduction, ...).
template <bool kKeepsStorage>
void reduced_loss(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, op.schema().arguments().size());
  if (args[2].toInt() == 0) return at::native::cpu_fallback(op, stack);  // Reduction::None
  const auto& self = args[0].toTensor();
  const auto shape = at::infer_size(self.sizes(), args[1].toTensor().sizes());
  at::Tensor result = kKeepsStorage ? at::empty(shape, self.options()) : at::Tensor();
  {
    auto temporary = at::empty(shape, self.options());
    at::native::cpu_fallback(op, stack);
  }
  if (kKeepsStorage) {
    result.resize_({});
    result.copy_(stack->back().toTensor());
    stack->back() = result;
  }
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("_reshape_alias", _reshape_alias);
  m.impl("view", view);
  m.impl("_copy_from", _copy_from);
  m.impl("_copy_from_and_resize", _copy_from_and_resize);
  m.impl("_local_scalar_dense", _local_scalar_dense);
  m.impl("set_.source_Tensor", set_source_Tensor_);
  m.impl("set_.source_Storage", set_source_Storage_);
  m.impl("set_.source_Storage_storage_offset", set_source_Storage_storage_offset_);
  m.impl("fill_.Scalar", fill_);
  m.impl("zero_", zero_);
  // view ops whose kernels are CPU's own (the fallback can't run views)
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("_thnn_fused_lstm_cell", lstm_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", lstm_cell_backward);
  m.impl("_thnn_fused_gru_cell", gru_cell);
  m.impl("_thnn_fused_gru_cell_backward", gru_cell_backward);
  // Ops whose generic (non-CPU) path doesn't work with the fallback, run whole
  // on CPU instead: convolution would call convolution_overrideable, which CPU
  // lacks; the functional losses would call their out= kernels, whose CPU
  // versions warn about resizing the scalar output.
  for (const char* name : {"convolution", "convolution_backward"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fallback>());
  for (const char* name : {"mse_loss", "smooth_l1_loss"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&reduced_loss<true>>());
  m.impl("huber_loss", torch::CppFunction::makeFromBoxedFunction<&reduced_loss<false>>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// Autocast: CUDA's policy (the op lists ATen shares between CUDA and XPU), so
// torch.autocast("nbmemdev") casts what torch.autocast("cuda") casts.
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                       int64_t) {
  TORCH_CHECK(false, "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
              "(as on CUDA): use binary_cross_entropy_with_logits / BCEWithLogitsLoss");
}

}  // namespace nbmemdev

namespace at::autocast {  // where ATen's autocast macros expect to be expanded

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define NBMEMDEV_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define NBMEMDEV_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define NBMEMDEV_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define NBMEMDEV_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(NBMEMDEV_LOWER)
  AT_FORALL_FP32(NBMEMDEV_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(NBMEMDEV_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(NBMEMDEV_PROMOTE)
  m.impl("binary_cross_entropy", nbmemdev::binary_cross_entropy_banned);
}

}  // namespace at::autocast

// ---------------------------------------------------------------------------
// C interface for ctypes
// ---------------------------------------------------------------------------

extern "C" {
void nbmemdev_set_capacity(int64_t bytes) { nbmemdev::g_allocator->setCapacity(static_cast<size_t>(bytes)); }
int64_t nbmemdev_capacity() { return static_cast<int64_t>(nbmemdev::g_allocator->capacity()); }
int64_t nbmemdev_cached_bytes() { return static_cast<int64_t>(nbmemdev::g_allocator->cachedBytes()); }
}
