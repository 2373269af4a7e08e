// A fixed pool of worker threads that runs `n` indexed tasks to completion.
// The calling thread works too, so a pool of one thread spawns nothing.
//
// Fork-safe: a child of fork() has none of the parent's workers, and the
// pool's mutexes may have been held by one of them at the fork. A
// pthread_atfork child handler (run while the child still has one thread)
// gives every live pool fresh state and abandons the old threads and locks
// without touching them; the next run() starts fresh workers under the run
// lock, so two threads of the child calling run() at once start them once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
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

  size_t size() const { return threads_; }

  // Runs task(i) for i in [0, n); rethrows the first exception after every
  // started task has finished, so no worker touches caller memory afterwards.
  void run(size_t n, const std::function<void(size_t)>& task);

 private:
  // Everything the workers share; replaced wholesale in a forked child.
  struct State {
    std::mutex mu;
    std::mutex run_mu;  // one run() at a time
    std::condition_variable wake, done;
    const std::function<void(size_t)>* task = nullptr;
    size_t n = 0;
    std::atomic<size_t> next{0};
    size_t finished = 0;
    uint64_t generation = 0;
    bool stop = false;
    std::exception_ptr error;
  };

  void start();
  void reset_in_child();
  static void register_pool(ThreadPool* pool, bool add);
  static void atfork_prepare();
  static void atfork_parent();
  static void atfork_child();
  static void worker_loop(State* st);
  static void drain(State* st);

  size_t threads_;
  std::unique_ptr<State> st_;
  // Workers, written only by the constructor, by run() under st_->run_mu, and
  // by the single-threaded fork child handler.
  std::vector<std::thread> workers_;
  bool need_start_ = false;  // set in a forked child: run() starts the workers
};

}  // namespace streamload
