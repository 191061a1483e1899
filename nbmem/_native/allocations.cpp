// nbmem's native engine for tracked mode: CPU allocations accounted in C++ (issue 12).
//
// A Python dispatch mode costs every op a trip into Python: 1.05-1.13x on
// small training steps before any accounting (benchmarks/bench_mode_floor.py).
// This library takes the allocator's own reports instead. c10's CPU allocator
// reports every allocation and free to the innermost PROFILER_STATE debug info
// of the thread (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter), as
// torch.profiler(profile_memory=True) receives them; ThreadLocalState carries
// it into at::parallel_for's workers and autograd's engine. The reporter here
// is a ProfilerStateBase whose config is Disabled, so torch sees no profiler
// running (torch.autograd.profiler's checks, record_function) while memory
// reports still arrive (memoryProfilingEnabled() is true).
//
// Everything a tracker needs per event happens here, under one mutex: live
// blocks by address (each rounded up to the CUDA allocator's 512 B), bytes by
// category and by module, the running peak and the breakdown at that peak.
// Python only classifies (a parameter, a gradient, a saved activation) from
// the hooks nbmem.categories installs, and reads the figures. The accounting
// mirrors nbmem/tracking.py's Tracker (classify, _grow, _release, _settle_peak).
//
// Loaded with ctypes.PyDLL (the GIL is held in every call); plain C entry points.

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace torch::autograd {
// torch/csrc/autograd/graph_task.h (declared here: that header pulls in the whole engine);
// -1 outside a backward, as torch._C._current_graph_task_id returns it
TORCH_API int get_current_graph_task_id();
}  // namespace torch::autograd

namespace {

using torch::profiler::impl::ActiveProfilerType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

constexpr int kCategories = 7;  // nbmem.results.CATEGORIES, most specific first; "other" last
constexpr int kOther = kCategories - 1;
constexpr int kNoModule = -1;  // made outside any module
constexpr int kBackward = -2;  // made during autograd's backward
constexpr int kKeep = INT_MIN;  // classify: leave the module as it is

struct Block {
  int64_t size;
  int32_t category;
  int32_t module;
  int64_t born;  // event number; -1 for blocks alive before tracking saw them (adopted)
};

struct Accounts {
  std::mutex mutex;
  std::unordered_map<int64_t, Block> live;
  // addresses a weak reference released (an adopted storage's death) that the
  // allocator may report freed right after: that report is not a new free
  std::unordered_set<int64_t> released;
  // the blocks of the last activation, by address: what a block adopted at the same address and
  // size was (a parameter, an activation autograd saved in the cell before); labels only, never bytes
  std::unordered_map<int64_t, Block> hints;
  int64_t block = 512;
  int64_t events = 0;
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t adopted = 0;  // bytes found alive before tracking (walked, or freed unseen: see free_reported)
  int64_t categories[kCategories] = {};
  std::vector<int64_t> modules = std::vector<int64_t>(2, 0);  // index: module id + 2
  // the breakdown at the running peak, taken lazily (nbmem.tracking.Tracker._settle_peak)
  bool settled = false;
  int64_t peak_event = 0;
  int32_t peak_module = kNoModule;
  int64_t peak_categories[kCategories] = {};
  std::vector<int64_t> peak_modules = std::vector<int64_t>(2, 0);
  int32_t module = kNoModule;  // the top-level module running now (set from Python's forward hooks)

  int64_t rounded(int64_t nbytes) const { return (nbytes + block - 1) / block * block; }

  int64_t& module_bytes(std::vector<int64_t>& table, int32_t id) {
    size_t index = static_cast<size_t>(id + 2);
    if (index >= table.size()) table.resize(index + 1, 0);
    return table[index];
  }

  void settle() {
    if (settled) return;
    std::copy(categories, categories + kCategories, peak_categories);
    peak_modules = modules;
    settled = true;
  }

  void grow(int64_t size, int32_t in_module) {
    allocated += size;
    if (allocated > peak) {
      peak = allocated;
      settled = false;
      peak_event = events;
      peak_module = in_module;
    }
  }

  void add(int64_t ptr, int64_t size, int32_t in_module, int64_t born) {
    live[ptr] = Block{size, kOther, in_module, born};
    categories[kOther] += size;
    module_bytes(modules, in_module) += size;
  }

  void remove(std::unordered_map<int64_t, Block>::iterator it) {
    if (allocated == peak) settle();
    const Block& found = it->second;
    allocated -= found.size;
    categories[found.category] -= found.size;
    module_bytes(modules, found.module) -= found.size;
    live.erase(it);
  }

  // bytes that were there before every open scope began: the running peak includes them too
  void adopt_bytes(int64_t ptr, int64_t size, int32_t in_module) {
    int32_t category = kOther;
    auto hint = hints.find(ptr);
    if (hint != hints.end() && hint->second.size == size) {
      category = hint->second.category;
      in_module = hint->second.module;
    }
    add(ptr, size, in_module, -1);
    if (category != kOther) {
      live[ptr].category = category;
      categories[kOther] -= size;
      categories[category] += size;
    }
    allocated += size;
    peak += size;
    adopted += size;
    if (settled) {
      peak_categories[category] += size;
      module_bytes(peak_modules, in_module) += size;
    }
  }

  void allocation_reported(int64_t ptr, int64_t nbytes, int32_t in_module) {
    ++events;
    released.erase(ptr);
    hints.erase(ptr);
    auto stale = live.find(ptr);
    if (stale != live.end()) remove(stale);  // its free went unseen; the address is in use again
    int64_t size = rounded(nbytes);
    add(ptr, size, in_module, events);
    grow(size, in_module);
  }

  void free_reported(int64_t ptr, int64_t nbytes, int32_t in_module) {
    ++events;
    auto it = live.find(ptr);
    if (it != live.end()) {
      remove(it);
    } else if (released.erase(ptr) == 0) {
      // A block allocated while an earlier tracked block ran (the allocator knew its size then)
      // and held only by C++ since (what autograd saved for a backward in a later cell): it was
      // there all along, so it is adopted, then freed.
      int64_t size = rounded(nbytes);
      adopt_bytes(ptr, size, in_module);
      remove(live.find(ptr));
    }
  }
};

Accounts accounts;

struct Reporter final : torch::profiler::impl::ProfilerStateBase {
  Reporter() : ProfilerStateBase(ProfilerConfig(ProfilerState::Disabled)) {}
  void reportMemoryUsage(void* ptr, int64_t bytes, size_t, size_t, c10::Device device) override {
    if (device.type() != c10::DeviceType::CPU || bytes == 0) return;
    bool backward = torch::autograd::get_current_graph_task_id() != -1;
    std::lock_guard<std::mutex> guard(accounts.mutex);
    int32_t in_module = backward ? kBackward : accounts.module;
    if (bytes > 0)
      accounts.allocation_reported(reinterpret_cast<int64_t>(ptr), bytes, in_module);
    else
      accounts.free_reported(reinterpret_cast<int64_t>(ptr), -bytes, in_module);
  }
  bool memoryProfilingEnabled() const override { return true; }
  ActiveProfilerType profilerType() override { return ActiveProfilerType::NONE; }
};

Reporter* innermost_reporter() {
  return dynamic_cast<Reporter*>(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE));
}

}  // namespace

extern "C" {

// 0: installed on this thread; 1: already installed; 2: refused, a profiler is running on this thread
int nbmem_install() {
  auto* current = c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE);
  if (current != nullptr) return dynamic_cast<Reporter*>(current) != nullptr ? 1 : 2;
  c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, std::make_shared<Reporter>());
  return 0;
}

// 1: removed; 0: not installed on this thread; -1: something else is on top of it (left in place)
int nbmem_uninstall() {
  if (innermost_reporter() == nullptr) return 0;
  try {
    c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
  } catch (const std::exception&) {
    return -1;
  }
  return 1;
}

int nbmem_installed() { return innermost_reporter() != nullptr ? 1 : 0; }

void nbmem_reset(int64_t block) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  accounts.hints.swap(accounts.live);
  accounts.live.clear();
  accounts.released.clear();
  accounts.block = block > 0 ? block : 1;
  accounts.events = accounts.allocated = accounts.peak = accounts.adopted = 0;
  std::fill(accounts.categories, accounts.categories + kCategories, 0);
  accounts.modules.assign(2, 0);
  accounts.settled = false;
  accounts.peak_event = 0;
  accounts.peak_module = kNoModule;
  accounts.module = kNoModule;
}

// A storage found alive: counted as there before every open scope (made_now 0) or as made
// now (1: another thread's tensor found at a block's end). Returns its rounded size, 0 if known.
int64_t nbmem_adopt(int64_t ptr, int64_t nbytes, int made_now) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  if (accounts.live.count(ptr)) return 0;
  int64_t size = accounts.rounded(nbytes);
  if (made_now) {
    ++accounts.events;
    accounts.add(ptr, size, kNoModule, accounts.events);
    accounts.grow(size, kNoModule);
  } else {
    accounts.adopt_bytes(ptr, size, kNoModule);
  }
  return size;
}

// A weak reference's callback, (address, the dead reference): an adopted storage died.
void nbmem_release(int64_t ptr, void* /* the weak reference */) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  auto it = accounts.live.find(ptr);
  if (it == accounts.live.end()) return;
  ++accounts.events;
  accounts.remove(it);
  accounts.released.insert(ptr);
}

// Moves the block to a more specific category (and module, unless kKeep); 1 if the block is known.
int nbmem_classify(int64_t ptr, int32_t category, int32_t module) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  auto it = accounts.live.find(ptr);
  if (it == accounts.live.end() || category < 0 || category >= kCategories) return 0;
  Block& found = it->second;
  bool more_specific = category < found.category;
  bool moved = module != kKeep && module != found.module;
  if (!more_specific && !moved) return 1;
  accounts.settle();
  bool at_peak = found.born <= accounts.peak_event;  // alive at the peak: it moves in the peak's breakdown too
  if (more_specific) {
    accounts.categories[found.category] -= found.size;
    accounts.categories[category] += found.size;
    if (at_peak) {
      accounts.peak_categories[found.category] -= found.size;
      accounts.peak_categories[category] += found.size;
    }
    found.category = category;
  }
  if (moved) {
    accounts.module_bytes(accounts.modules, found.module) -= found.size;
    accounts.module_bytes(accounts.modules, module) += found.size;
    if (at_peak) {
      accounts.module_bytes(accounts.peak_modules, found.module) -= found.size;
      accounts.module_bytes(accounts.peak_modules, module) += found.size;
    }
    found.module = module;
  }
  return 1;
}

// The live block at an address as (size, category, module, born); 0 if there is none.
int nbmem_block(int64_t ptr, int64_t* out) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  auto it = accounts.live.find(ptr);
  if (it == accounts.live.end()) return 0;
  out[0] = it->second.size;
  out[1] = it->second.category;
  out[2] = it->second.module;
  out[3] = it->second.born;
  return 1;
}

void nbmem_set_module(int32_t module) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  accounts.module = module;
}

void nbmem_reset_peak() {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  accounts.peak = accounts.allocated;
  accounts.settled = false;
  accounts.peak_event = accounts.events;
  accounts.peak_module = accounts.module;
}

// allocated, peak, adopted, events, live blocks, the peak's event and module
void nbmem_figures(int64_t* out) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  out[0] = accounts.allocated;
  out[1] = accounts.peak;
  out[2] = accounts.adopted;
  out[3] = accounts.events;
  out[4] = static_cast<int64_t>(accounts.live.size());
  out[5] = accounts.peak_event;
  out[6] = accounts.peak_module;
}

// Bytes by category (7) then by module id + 2 (up to room - 7 of them), now or at the peak.
// Returns how many module slots there are (call again with more room if that is more).
int64_t nbmem_breakdown(int64_t* out, int64_t room, int at_peak) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  if (at_peak) accounts.settle();
  const int64_t* categories = at_peak ? accounts.peak_categories : accounts.categories;
  const std::vector<int64_t>& modules = at_peak ? accounts.peak_modules : accounts.modules;
  std::copy(categories, categories + kCategories, out);
  int64_t slots = static_cast<int64_t>(modules.size());
  for (int64_t index = 0; index < slots && kCategories + index < room; ++index) out[kCategories + index] = modules[index];
  return slots;
}

// Every live block as (address, size, category, module, born); returns how many there are.
int64_t nbmem_blocks(int64_t* out, int64_t room) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  int64_t index = 0;
  for (const auto& [ptr, found] : accounts.live) {
    if ((index + 1) * 5 <= room) {
      int64_t* row = out + index * 5;
      row[0] = ptr;
      row[1] = found.size;
      row[2] = found.category;
      row[3] = found.module;
      row[4] = found.born;
    }
    ++index;
  }
  return index;
}

}  // extern "C"
