// nbmem's native engine for tracked mode: CPU allocations accounted in C++ (issue 12).
//
// A Python dispatch mode costs every op a trip into Python: 1.05-1.13x on
// small training steps before any accounting (benchmarks/bench_mode_floor.py).
// This library sees allocations instead. The CPU allocator registered with
// c10 (c10::GetAllocator(kCPU), what at::empty and CPU kernels allocate
// through; raw_allocate too, as mkldnn does) is wrapped when the first block
// is tracked, at the priority it had, and stays wrapped until nbmem is
// unloaded (nbmem_unregister): between blocks the wrapper only passes
// allocations through, so that memory raw-allocated in a block and handed to
// raw_deallocate after it (mkldnn's buffers look the allocator up again to free)
// is still counted out, and c10's registry, not thread-safe, is written twice
// rather than at every block. While a block is tracked an allocation goes to the
// original allocator and is counted; its DataPtr keeps the allocation's own
// address as its context (a "simple" data pointer, as c10's copy-on-write and
// raw_deallocate expect) with a deleter of this library's, which counts the
// free, from any thread and at any time, and then calls the original deleter.
// Nothing else of torch is touched: torch.profiler runs inside a tracked block
// and sees what it always sees.
//
// Everything a tracker needs per event happens here, under one mutex: live
// blocks by address (each rounded up to the CUDA allocator's 512 B), bytes by
// category and by module, the running peak and the breakdown at that peak.
// Python classifies (a parameter, a gradient, a saved activation) from the
// hooks nbmem.tracking.categories installs, adopts the storages alive before (their
// frees come from weak references whose callbacks are nbmem_release), and
// reads the figures. The accounting mirrors nbmem/tracking/tracker.py's Tracker
// (classify, _grow, _release, _settle_peak).
//
// Lines (issue 23: %%gpumem --lines): while asked for, each allocation on the thread that asked is
// charged to the innermost frame of the user's code on that thread's Python stack (a cell, a
// script: not PyTorch, nbmem, the standard library or site-packages; Python says which file
// names are not the user's). The stack is read under the GIL, taken first if the thread let it go
// (autograd's backward on the CPU runs on the calling thread with the GIL released: its
// allocations go to the `loss.backward()` line), and before the accounts' mutex, never under it,
// as PyTorch's own allocator gathers Python stacks for its memory history. No Python code runs
// there (a Ctrl-C is never raised into an allocation). An allocation on another Python thread
// goes to the line the asking thread is at; on a thread Python never saw (an OpenMP worker's),
// to the line last charged.
//
// Host memory (an optimizer's step counters, CPU tensors on a GPU: nbmem.tracking.host_counters): while a thread
// says so (nbmem_host), its allocations pass through uncounted; nbmem_forget takes a counted block out.
//
// Loaded with ctypes.PyDLL (the GIL is held in every call from Python); plain
// C entry points. The few Python C API functions used are declared here, not
// from Python.h, so that building needs no Python development headers.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

extern "C" {
// The Python C API this file uses (all there since Python 3.10; PyFrame_GetLasti since 3.11, weak:
// without it each line is read from the frame every time).
typedef struct _object PyObject;
typedef struct _frame PyFrameObject;
typedef struct _ts PyThreadState;
typedef struct _is PyInterpreterState;
typedef enum { PyGILState_LOCKED, PyGILState_UNLOCKED } PyGILState_STATE;
int Py_IsInitialized(void);
PyThreadState* PyGILState_GetThisThreadState(void);
PyGILState_STATE PyGILState_Ensure(void);
void PyGILState_Release(PyGILState_STATE);
PyFrameObject* PyThreadState_GetFrame(PyThreadState*);
uint64_t PyThreadState_GetID(PyThreadState*);
PyInterpreterState* PyThreadState_GetInterpreter(PyThreadState*);
PyThreadState* PyInterpreterState_ThreadHead(PyInterpreterState*);
PyThreadState* PyThreadState_Next(PyThreadState*);
int PyGC_Disable(void);
int PyGC_Enable(void);
PyFrameObject* PyFrame_GetBack(PyFrameObject*);
PyObject* PyFrame_GetCode(PyFrameObject*);
int PyFrame_GetLineNumber(PyFrameObject*);
int PyFrame_GetLasti(PyFrameObject*) __attribute__((weak));
PyObject* PyObject_GetAttrString(PyObject*, const char*);
const char* PyUnicode_AsUTF8(PyObject*);
void PyErr_Fetch(PyObject**, PyObject**, PyObject**);
void PyErr_Restore(PyObject*, PyObject*, PyObject*);
void Py_IncRef(PyObject*);
void Py_DecRef(PyObject*);
}

namespace torch::autograd {
// torch/csrc/autograd/graph_task.h (declared here: that header pulls in the whole engine);
// -1 outside a backward, as torch._C._current_graph_task_id returns it
TORCH_API int get_current_graph_task_id();
}  // namespace torch::autograd

namespace {

constexpr int kCategories = 7;  // nbmem.core.results.CATEGORIES, most specific first; "other" last
constexpr int kOther = kCategories - 1;
constexpr int kNoModule = -1;  // made outside any module
constexpr int kBackward = -2;  // made during autograd's backward
constexpr int kKeep = INT_MIN;  // classify: leave the module as it is
constexpr int32_t kBefore = -1;  // line of a block alive before lines were asked for (or made while they were not)

struct Block {
  int64_t size;
  int32_t category;
  int32_t module;
  int32_t line;
  int64_t born;  // event number; -1 for blocks alive before tracking saw them (adopted)
  int64_t serial;  // which block at this address: a weak reference releases only its own
  int64_t watchers;  // adopted: storages whose weak references hold it (lazy clones share one)
};

// What one weak reference watches: the block (address, serial) its storage was adopted into.
struct Watch {
  int64_t ptr;
  int64_t serial;
};

struct Accounts {
  std::mutex mutex;
  std::unordered_map<int64_t, Block> live;
  // Weak references by token (nbmem_adopt, nbmem_release). Python makes and keeps a storage's weak
  // reference, with its token, before the block is adopted: Ctrl-C between the two then leaves a
  // reference that releases nothing, never an adopted block that no reference will release.
  std::unordered_map<int64_t, Watch> watches;
  int64_t block = 512;
  int64_t events = 0;
  int64_t serials = 0;
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t adopted = 0;  // bytes found alive before tracking saw them
  int64_t categories[kCategories] = {};
  std::vector<int64_t> modules = std::vector<int64_t>(2, 0);  // index: module id + 2
  // the breakdown at the running peak, taken lazily (nbmem.tracking.tracker.Tracker._settle_peak)
  bool settled = false;
  int64_t peak_event = 0;
  int32_t peak_module = kNoModule;
  int64_t peak_categories[kCategories] = {};
  std::vector<int64_t> peak_modules = std::vector<int64_t>(2, 0);
  int32_t module = kNoModule;  // the top-level module running now (set from Python's forward hooks)
  // bytes by line id + 1 (slot 0: alive before), live now, at the peak, and allocated since lines began
  std::vector<int64_t> lines = std::vector<int64_t>(1, 0);
  std::vector<int64_t> peak_lines = std::vector<int64_t>(1, 0);
  std::vector<int64_t> lines_allocated = std::vector<int64_t>(1, 0);

  int64_t rounded(int64_t nbytes) const { return (nbytes + block - 1) / block * block; }

  // a table's slot, the table grown to hold it
  static int64_t& slot(std::vector<int64_t>& table, size_t index) {
    if (index >= table.size()) table.resize(index + 1, 0);
    return table[index];
  }

  int64_t& module_bytes(std::vector<int64_t>& table, int32_t id) { return slot(table, static_cast<size_t>(id + 2)); }

  int64_t& line_bytes(std::vector<int64_t>& table, int32_t id) { return slot(table, static_cast<size_t>(id + 1)); }

  void settle() {
    if (settled) return;
    std::copy(categories, categories + kCategories, peak_categories);
    peak_modules = modules;
    peak_lines = lines;
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

  int64_t add(int64_t ptr, int64_t size, int32_t in_module, int64_t born, int32_t line = kBefore) {
    live[ptr] = Block{size, kOther, in_module, line, born, ++serials, 1};
    categories[kOther] += size;
    module_bytes(modules, in_module) += size;
    line_bytes(lines, line) += size;
    if (born != -1) line_bytes(lines_allocated, line) += size;  // made now: charged as made, "(alive before)" too
    return serials;
  }

  void remove(std::unordered_map<int64_t, Block>::iterator it) {
    if (allocated == peak) settle();
    const Block& found = it->second;
    allocated -= found.size;
    categories[found.category] -= found.size;
    module_bytes(modules, found.module) -= found.size;
    line_bytes(lines, found.line) -= found.size;
    live.erase(it);
  }

  // a new block, counted now; returns its serial
  int64_t allocation_seen(int64_t ptr, int64_t nbytes, int32_t in_module, int32_t line) {
    ++events;
    auto stale = live.find(ptr);
    // an adopted block here died unseen (resized in place before it was watched again): gone
    if (stale != live.end()) remove(stale);
    int64_t size = rounded(nbytes);
    int64_t serial = add(ptr, size, in_module, events, line);
    grow(size, in_module);
    return serial;
  }

  void free_seen(int64_t ptr) {
    auto it = live.find(ptr);
    if (it == live.end()) return;
    ++events;
    remove(it);
  }
};

// Never destroyed: a block allocated while a block was tracked may be freed during the process's
// exit, by another library's static destructor, after this library's own statics are gone.
Accounts& accounts = *new Accounts;

// A child forked while another thread holds the mutex would wait on it for ever: fork takes it
// first, and both sides let go (a DataLoader's workers fork while a block is tracked).
void before_fork() { accounts.mutex.lock(); }
void after_fork() { accounts.mutex.unlock(); }
void in_the_child();  // below: the child also charges no lines (the thread that asked is not there)
const int fork_handlers = pthread_atfork(before_fork, after_fork, in_the_child);

// -- lines -------------------------------------------------------------------

// What the lines need besides the accounts. `on`, `asking` and `last` are read by any thread; the rest
// only with the GIL held (every call from Python holds it, and line_now takes it), which guards it.
struct Lines {
  std::atomic<bool> on{false};
  std::atomic<uint64_t> asking{0};  // the thread that asked for lines: its thread state's id (0: none)
  std::atomic<int32_t> last{kBefore};  // the line last charged on it
  std::vector<std::string> prefixes, infixes;  // a file name starting with or containing one is not the user's
  struct Code {
    bool users;
    std::string file;
  };
  std::unordered_map<PyObject*, Code> codes;  // code objects met, each with a reference held until forget()
  std::map<std::pair<PyObject*, int>, int32_t> at;  // (code, instruction offset) -> line id
  std::map<std::pair<std::string, int>, int32_t> ids;  // (file, line number) -> line id
  std::vector<std::pair<std::string, int>> where;  // line id -> (file, line number)

  const Code& code_of(PyObject* code) {
    auto found = codes.find(code);
    if (found != codes.end()) return found->second;
    std::string file;  // (walk keeps an exception pending as it was, and the collector off)
    if (PyObject* name = PyObject_GetAttrString(code, "co_filename")) {
      if (const char* text = PyUnicode_AsUTF8(name)) file = text;
      Py_DecRef(name);
    }
    bool users = !file.empty();
    for (const std::string& prefix : prefixes) users = users && file.compare(0, prefix.size(), prefix) != 0;
    for (const std::string& infix : infixes) users = users && file.find(infix) == std::string::npos;
    Py_IncRef(code);
    return codes.emplace(code, Code{users, file}).first->second;
  }

  int32_t id_of(const std::string& file, int number) {
    auto found = ids.find({file, number});
    if (found != ids.end()) return found->second;
    int32_t id = static_cast<int32_t>(where.size());
    where.emplace_back(file, number);
    ids.emplace(std::make_pair(file, number), id);
    return id;
  }

  // The asking thread's state, if it still has one (a thread that ended has none). GIL held.
  PyThreadState* asking_thread(PyThreadState* mine) {
    uint64_t wanted = asking.load();
    if (wanted == 0) return nullptr;
    if (PyThreadState_GetID(mine) == wanted) return mine;
    for (PyThreadState* other = PyInterpreterState_ThreadHead(PyThreadState_GetInterpreter(mine)); other != nullptr;
         other = PyThreadState_Next(other)) {
      if (PyThreadState_GetID(other) == wanted) return other;
    }
    return nullptr;
  }

  // The innermost frame of the user's code on `thread`'s stack, as a line id; kBefore if none. GIL held.
  // Making frame objects may start a garbage collection, which would run finalizers (any Python code)
  // inside the allocation: the collector is off meanwhile, and an exception pending is left as it was.
  int32_t walk(PyThreadState* thread) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int collecting = PyGC_Disable();
    int32_t found = innermost(thread);
    if (collecting) PyGC_Enable();
    PyErr_Restore(type, value, traceback);
    return found;
  }

  int32_t innermost(PyThreadState* thread) {
    PyFrameObject* frame = PyThreadState_GetFrame(thread);
    while (frame != nullptr) {
      PyObject* code = PyFrame_GetCode(frame);
      const Code& known = code_of(code);
      if (known.users) {
        int32_t id;
        if (PyFrame_GetLasti != nullptr) {
          auto key = std::make_pair(code, PyFrame_GetLasti(frame));
          auto found = at.find(key);
          id = found != at.end() ? found->second : (at[key] = id_of(known.file, PyFrame_GetLineNumber(frame)));
        } else {
          id = id_of(known.file, PyFrame_GetLineNumber(frame));
        }
        Py_DecRef(code);
        Py_DecRef(reinterpret_cast<PyObject*>(frame));
        return id;
      }
      Py_DecRef(code);
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DecRef(reinterpret_cast<PyObject*>(frame));
      frame = back;
    }
    return kBefore;
  }

  // The line an allocation made now is charged to (never called under the accounts' mutex). On
  // another Python thread: the line the asking thread is at meanwhile (as sys._current_frames reads
  // it); on a thread Python never saw, which can't take the GIL without a thread state of its own:
  // the line last charged.
  int32_t line_now() {
    if (!on.load(std::memory_order_relaxed)) return kBefore;
    PyThreadState* mine = Py_IsInitialized() ? PyGILState_GetThisThreadState() : nullptr;
    if (mine == nullptr) return last.load();
    PyGILState_STATE state = PyGILState_Ensure();
    PyThreadState* thread = on.load() ? asking_thread(mine) : nullptr;
    int32_t found = thread != nullptr ? walk(thread) : kBefore;
    PyGILState_Release(state);
    if (found == kBefore) return last.load();  // no frame of the user's (nbmem's own code): the line before
    last.store(found);
    return found;
  }

  // Drops every reference held and every id. GIL held, lines off. The tables are emptied first: a
  // code object's end may run Python code, which must find them consistent.
  void forget() {
    std::unordered_map<PyObject*, Code> held;
    held.swap(codes);
    at.clear();
    ids.clear();
    where.clear();
    last.store(kBefore);
    for (auto& [code, known] : held) Py_DecRef(code);
  }
};

Lines& lines = *new Lines;  // never destroyed, as the accounts

void in_the_child() {
  lines.on.store(false);
  lines.asking.store(0);
  after_fork();
}

// -- the wrapping allocator ------------------------------------------------

c10::Allocator* inner = nullptr;  // the CPU allocator that was registered when nbmem first wrapped it
c10::DeleterFnPtr inner_deleter = nullptr;  // its deleter for a simple data pointer
uint8_t inner_priority = 0;  // the priority it was registered with (found when wrapping it)
std::atomic<bool> counting_on{false};  // a block is tracked: count; else pass allocations through
// above 0: this thread makes host memory (an optimizer's step counters on a GPU): passed through, never counted.
// Valid while its generation is the current one: nbmem_host_reset() ends every thread's at once.
thread_local int host_depth = 0;
thread_local int64_t host_generation = 0;
std::atomic<int64_t> host_generations{1};

bool hosting() { return host_depth > 0 && host_generation == host_generations.load(std::memory_order_relaxed); }

void counted_delete(void* data) {
  {
    // counted first: once the memory is back, another thread may be given the same address
    std::lock_guard<std::mutex> guard(accounts.mutex);
    accounts.free_seen(reinterpret_cast<int64_t>(data));
  }
  inner_deleter(data);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr made = inner->allocate(nbytes);
    if (!counting_on.load(std::memory_order_relaxed) || hosting()) return made;
    void* data = made.get();
    if (data == nullptr || made.get_context() != data || made.get_deleter() != inner_deleter) {
      return made;  // not a simple data pointer of the allocator wrapped: left as it is, uncounted
    }
    c10::Device device = made.device();
    made.release_context();
    int32_t in_module = torch::autograd::get_current_graph_task_id() != -1 ? kBackward : kNoModule;
    int32_t line = lines.line_now();  // before the mutex: it may wait for the GIL
    {
      std::lock_guard<std::mutex> guard(accounts.mutex);
      if (in_module != kBackward) in_module = accounts.module;
      accounts.allocation_seen(reinterpret_cast<int64_t>(data), static_cast<int64_t>(nbytes), in_module, line);
    }
    return {data, data, &counted_delete, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator& counting = *new CountingAllocator;  // never destroyed, for the same reason

}  // namespace

extern "C" {

// Registers the counting allocator in place of the CPU allocator, at its priority, if not yet.
// 0: registered now or before; 2: the registered CPU allocator can't be wrapped (no raw deleter);
// 3: another CPU allocator was registered since nbmem first wrapped one.
int register_counting() {
  c10::Allocator* current = c10::GetAllocator(c10::DeviceType::CPU);
  if (current == &counting) return 0;
  c10::DeleterFnPtr deleter = current->raw_deleter();
  if (deleter == nullptr) return 2;
  if (inner != nullptr && (inner != current || inner_deleter != deleter)) return 3;
  inner = current;
  inner_deleter = deleter;
  // SetAllocator replaces only at a priority at least the registered one's, and nothing says
  // which that is: the first that takes is it, and putting the original back there restores it
  for (int priority = 0; priority <= UINT8_MAX; ++priority) {
    c10::SetAllocator(c10::DeviceType::CPU, &counting, static_cast<uint8_t>(priority));
    if (c10::GetAllocator(c10::DeviceType::CPU) == &counting) {
      inner_priority = static_cast<uint8_t>(priority);
      return 0;
    }
  }
  return 2;
}

// Start counting (a block is tracked). 0: counting; 2 or 3: see register_counting.
int nbmem_install() {
  int refused = register_counting();
  if (refused == 0) counting_on.store(true);
  return refused;
}

// Stop counting; the wrapper stays registered and passes allocations through. 1 if it was counting.
int nbmem_uninstall() {
  bool was = counting_on.exchange(false);
  std::lock_guard<std::mutex> guard(accounts.mutex);
  accounts.module = kNoModule;
  return was ? 1 : 0;
}

// Whether allocations are being counted now.
int nbmem_installed() { return counting_on.load() ? 1 : 0; }

// Whether the counting allocator is c10's CPU allocator (counting or passing through).
int nbmem_registered() { return c10::GetAllocator(c10::DeviceType::CPU) == &counting ? 1 : 0; }

// Put the original CPU allocator back (nbmem unloaded). 1: back; 0: nbmem's was not registered;
// -1: someone registered theirs above nbmem's meanwhile (theirs is left in place).
int nbmem_unregister() {
  counting_on.store(false);
  if (c10::GetAllocator(c10::DeviceType::CPU) != &counting) return inner == nullptr ? 0 : -1;
  for (int priority = inner_priority; priority <= UINT8_MAX; ++priority) {
    c10::SetAllocator(c10::DeviceType::CPU, inner, static_cast<uint8_t>(priority));
    if (c10::GetAllocator(c10::DeviceType::CPU) == inner) return 1;
  }
  return -1;
}

// The address of a storage's memory, without materializing a copy-on-write one (as
// UntypedStorage.data_ptr() would): the argument is UntypedStorage._cdata.
int64_t nbmem_storage_address(int64_t cdata) {
  return reinterpret_cast<int64_t>(reinterpret_cast<c10::StorageImpl*>(cdata)->data());
}

void nbmem_reset(int64_t block) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  accounts.live.clear();
  accounts.watches.clear();
  accounts.block = block > 0 ? block : 1;
  accounts.events = accounts.allocated = accounts.peak = accounts.adopted = 0;
  std::fill(accounts.categories, accounts.categories + kCategories, 0);
  accounts.modules.assign(2, 0);
  accounts.lines.assign(1, 0);
  accounts.peak_lines.assign(1, 0);
  accounts.lines_allocated.assign(1, 0);
  accounts.settled = false;
  accounts.peak_event = 0;
  accounts.peak_module = kNoModule;
  accounts.module = kNoModule;
}

// A storage found alive, its weak reference (token) kept already: counted as there before every
// open scope (made_now 0) or as made now (1: found at a block's end, made where no allocation was
// seen), and watched by the token. Idempotent per token, so a walk Ctrl-C cut short just asks
// again. Returns 1 if the token watches the block now, 0 if its free is counted anyway (allocated
// while counting): then the reference has nothing to release.
int nbmem_adopt(int64_t ptr, int64_t nbytes, int made_now, int64_t token) {
  int32_t line = made_now ? lines.line_now() : kBefore;
  std::lock_guard<std::mutex> guard(accounts.mutex);
  if (accounts.watches.count(token)) return 1;  // adopted for this token before the interrupt
  auto known = accounts.live.find(ptr);
  int64_t serial;
  if (known != accounts.live.end()) {
    if (known->second.born != -1) return 0;  // allocated while counting: its free is counted
    ++known->second.watchers;  // adopted already, for another storage (a lazy clone): one more to die
    serial = known->second.serial;
  } else if (made_now) {
    serial = accounts.allocation_seen(ptr, nbytes, kNoModule, line);
  } else {
    int64_t size = accounts.rounded(nbytes);
    serial = accounts.add(ptr, size, kNoModule, -1);
    accounts.allocated += size;
    accounts.peak += size;  // there all along: the running peak includes it too
    accounts.adopted += size;
    if (accounts.settled) {
      accounts.peak_categories[kOther] += size;
      accounts.module_bytes(accounts.peak_modules, kNoModule) += size;
      accounts.line_bytes(accounts.peak_lines, kBefore) += size;
    }
  }
  accounts.watches[token] = Watch{ptr, serial};
  return 1;
}

// A weak reference's callback, (token, the dead reference): its storage died, or (called with
// None) it moved to another block. Releases the block it watches, once: a token never adopted,
// or released already, releases nothing.
void nbmem_release(int64_t token, void* /* the weak reference */) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  auto watch = accounts.watches.find(token);
  if (watch == accounts.watches.end()) return;
  Watch watched = watch->second;
  accounts.watches.erase(watch);
  auto it = accounts.live.find(watched.ptr);
  if (it == accounts.live.end() || it->second.serial != watched.serial) return;
  if (--it->second.watchers > 0) return;
  ++accounts.events;
  accounts.remove(it);
}

// This thread's host-memory depth (nbmem.tracking.host_counters): above 0, its allocations are host memory. Sets it
// and returns what it was; a negative depth only reads it.
int nbmem_host(int depth) {
  int was = hosting() ? host_depth : 0;
  if (depth >= 0) {
    host_depth = depth;
    host_generation = host_generations.load();
  }
  return was;
}

// Every thread's depth back to 0 at once (a block begins or ends: what a Ctrl-C in on_host() left on goes).
void nbmem_host_reset() { host_generations.fetch_add(1); }

// The block at `ptr` left the device (moved to host memory): no longer counted, its free ignored. 1 if it was counted.
int nbmem_forget(int64_t ptr) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  auto it = accounts.live.find(ptr);
  if (it == accounts.live.end()) return 0;
  ++accounts.events;
  accounts.remove(it);
  return 1;
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

// Lines are now read from the calling thread's stack (the newest scope that asked for them).
void nbmem_lines_here() { lines.asking.store(PyThreadState_GetID(PyGILState_GetThisThreadState())); }

// Lines from now on, asked for by the calling thread: every live block is counted as alive before,
// here and at the peak. `not_users`: the prefixes of file names that are not the user's, one per
// line, then an empty line, then the parts that make a file name not the user's wherever they are.
void nbmem_lines_start(const char* not_users) {
  lines.on.store(false);
  lines.forget();
  lines.prefixes.clear();
  lines.infixes.clear();
  std::istringstream rules(not_users);
  std::vector<std::string>* into = &lines.prefixes;
  for (std::string rule; std::getline(rules, rule);) {
    if (rule.empty()) into = &lines.infixes;
    else into->push_back(rule);
  }
  {
    std::lock_guard<std::mutex> guard(accounts.mutex);
    accounts.settle();
    for (auto& [ptr, found] : accounts.live) found.line = kBefore;
    accounts.lines.assign(1, accounts.allocated);
    accounts.lines_allocated.assign(1, 0);
    int64_t at_peak = 0;  // everything alive at the peak so far was there before
    for (int64_t size : accounts.peak_categories) at_peak += size;
    accounts.peak_lines.assign(1, at_peak);
  }
  nbmem_lines_here();
  lines.on.store(true);
}

// No more lines (the tables stay readable until the next start).
void nbmem_lines_stop() { lines.on.store(false); }

// Drops the code objects the lines hold (once their figures are read).
void nbmem_lines_forget() {
  lines.on.store(false);
  lines.forget();
}

// Bytes by line id + 1 (slot 0: alive before): which 0 live now, 1 at the peak, 2 allocated since
// lines began. Returns how many slots there are (call again with more room if that is more).
int64_t nbmem_lines(int64_t* out, int64_t room, int which) {
  std::lock_guard<std::mutex> guard(accounts.mutex);
  if (which == 1) accounts.settle();
  const std::vector<int64_t>& table =
      which == 0 ? accounts.lines : which == 1 ? accounts.peak_lines : accounts.lines_allocated;
  int64_t slots = static_cast<int64_t>(table.size());
  for (int64_t index = 0; index < slots && index < room; ++index) out[index] = table[index];
  return slots;
}

// A line id's file name (UTF-8; valid until the next start or forget) and line number; null if unknown.
const char* nbmem_line_where(int32_t id, int32_t* number) {
  if (id < 0 || static_cast<size_t>(id) >= lines.where.size()) return nullptr;
  *number = lines.where[id].second;
  return lines.where[id].first.c_str();
}

}  // extern "C"
