// The exchange of shared_memory.py's SharedMemorySum in C++: the same buffer and protocol, for
// the 62 exchanges of a decoding step. Called from Python, an exchange spent 30-60 us in the
// interpreter and in torch's dispatch to a Python operator; here it is a copy, a flag and a wait.
//
// buffer: the mapped file, uint8. Rank r's flag (an int64, the number of its last published
// call) heads cache line r, its process id next to it; then two parities of world_size slots of
// `capacity` floats each.

#include <immintrin.h>
#include <pybind11/pybind11.h>
#include <sched.h>
#include <torch/library.h>
#include <torch/types.h>

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kFlagStride = 8;  // int64s per flag: one cache line each
constexpr int kSpinsBeforeYield = 64;
constexpr double kSignalCheckSeconds = 0.01;

// Run Python's signal handlers, as the interpreter does between bytecodes: Ctrl-C must stop a
// rank that waits for another which Ctrl-C stopped first. Their exception (KeyboardInterrupt)
// is thrown on for torch to hand back to Python.
void check_python_signals() {
  if (!Py_IsInitialized()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  if (PyErr_CheckSignals() != 0) {
    pybind11::error_already_set raised;  // takes the pending exception
    PyGILState_Release(gil);
    throw raised;
  }
  PyGILState_Release(gil);
}

// Whether process pid has ended (or was killed): gone, or a zombie its launcher has not reaped.
bool process_gone(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;  // no /proc: the kill() above has to do
  const size_t name_end = line.rfind(')');
  return name_end != std::string::npos && name_end + 2 < line.size() && line[name_end + 2] == 'Z';
}

// Publish x in this rank's slot for its next call, then wait until every rank has published it.
// Returns the slots of the call's parity: [world_size][capacity].
const float* publish_and_wait(const at::Tensor& x, const at::Tensor& buffer, int64_t rank, int64_t world_size,
                          int64_t capacity, double timeout_seconds) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.numel() <= capacity, "x must be fp32 and fit a slot");
  uint8_t* base = buffer.data_ptr<uint8_t>();
  int64_t* flags = reinterpret_cast<int64_t*>(base);
  float* slots = reinterpret_cast<float*>(base + kFlagStride * sizeof(int64_t) * world_size);
  const int64_t call = __atomic_load_n(&flags[kFlagStride * rank], __ATOMIC_RELAXED) + 1;
  float* parity = slots + (call % 2) * world_size * capacity;
  const at::Tensor contiguous = x.contiguous();
  std::memcpy(parity + rank * capacity, contiguous.data_ptr<float>(), x.numel() * sizeof(float));
  __atomic_store_n(&flags[kFlagStride * rank], call, __ATOMIC_RELEASE);  // the data before the flag
  const auto start = std::chrono::steady_clock::now();
  double signals_checked = 0;  // seconds into the wait
  for (int64_t other = 0; other < world_size; ++other) {
    int spins = 0;
    while (__atomic_load_n(&flags[kFlagStride * other], __ATOMIC_ACQUIRE) < call) {
      if (++spins < kSpinsBeforeYield) {
        _mm_pause();
        continue;
      }
      spins = 0;
      sched_yield();  // the other ranks may need this core to get here
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
      if (waited.count() > signals_checked + kSignalCheckSeconds) {
        check_python_signals();
        signals_checked = waited.count();
        // A rank killed mid-step never publishes: say so now rather than at the timeout. Its flag
        // is read again once it is gone: it may have published this call and ended its job
        // since the read above (the job's last exchange, on a machine busy enough).
        const int64_t pid = __atomic_load_n(&flags[kFlagStride * other + 1], __ATOMIC_RELAXED);
        TORCH_CHECK(pid <= 0 || !process_gone(pid) ||
                        __atomic_load_n(&flags[kFlagStride * other], __ATOMIC_ACQUIRE) >= call,
                    "rank ", rank, " lost rank ", other, " (process ", pid,
                    " is gone) while waiting for the other ranks' tensors");
      }
      TORCH_CHECK(waited.count() < timeout_seconds, "rank ", rank, " timed out after ", timeout_seconds,
                  " s waiting for the other ranks' tensors");
    }
  }
  return parity;
}

// The sum of every rank's x, added in rank order so that every rank gets the same bits.
at::Tensor shared_sum(const at::Tensor& x, const at::Tensor& buffer, int64_t rank, int64_t world_size,
                      int64_t capacity, double timeout_seconds) {
  const float* slots = publish_and_wait(x, buffer, rank, world_size, capacity, timeout_seconds);
  at::Tensor total = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  float* out = total.data_ptr<float>();
  const int64_t n = x.numel();
  std::memcpy(out, slots, n * sizeof(float));
  for (int64_t other = 1; other < world_size; ++other) {
    const float* slot = slots + other * capacity;
    for (int64_t i = 0; i < n; ++i) out[i] += slot[i];
  }
  return total;
}

// Every rank's x [..., n] side by side in rank order: [..., world_size * n].
at::Tensor shared_gather(const at::Tensor& x, const at::Tensor& buffer, int64_t rank, int64_t world_size,
                         int64_t capacity, double timeout_seconds) {
  const float* slots = publish_and_wait(x, buffer, rank, world_size, capacity, timeout_seconds);
  std::vector<int64_t> sizes = x.sizes().vec();
  const int64_t width = sizes.back(), rows = width == 0 ? 0 : x.numel() / width;
  sizes.back() = width * world_size;
  at::Tensor gathered = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  float* out = gathered.data_ptr<float>();
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t other = 0; other < world_size; ++other) {
      std::memcpy(out + (row * world_size + other) * width, slots + other * capacity + row * width,
                  width * sizeof(float));
    }
  }
  return gathered;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("shared_sum(Tensor x, Tensor buffer, int rank, int world_size, int capacity, float timeout_seconds) -> Tensor");
  m.def("shared_gather(Tensor x, Tensor buffer, int rank, int world_size, int capacity, float timeout_seconds) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) {
  m.impl("shared_sum", shared_sum);
  m.impl("shared_gather", shared_gather);
}
