// A fixed pool of worker threads that runs `n` indexed tasks to completion.
// The calling thread works too, so a pool of one thread spawns nothing.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace streamload {

class ThreadPool {
 public:
  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }

  // Runs task(i) for i in [0, n); rethrows the first exception after every
  // started task has finished, so no worker touches caller memory afterwards.
  void run(size_t n, const std::function<void(size_t)>& task);

 private:
  void worker_loop();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::mutex run_mu_;  // one run() at a time
  std::condition_variable wake_, done_;
  const std::function<void(size_t)>* task_ = nullptr;
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  size_t finished_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace streamload
