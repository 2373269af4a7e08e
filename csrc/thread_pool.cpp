#include "thread_pool.h"

namespace streamload {

ThreadPool::ThreadPool(size_t threads) {
  for (size_t i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::drain() {
  for (;;) {
    size_t i = next_.fetch_add(1);
    if (i >= n_) return;
    try {
      (*task_)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_);  // stop handing out work after the first failure
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++finished_;
    }
    done_.notify_all();
  }
}

void ThreadPool::run(size_t n, const std::function<void(size_t)>& task) {
  if (n == 0) return;
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    task_ = &task;
    n_ = n;
    next_.store(0);
    error_ = nullptr;
    finished_ = 0;
    ++generation_;
  }
  // Every worker takes part in every generation, so none is left running
  // with a stale task when run() returns.
  wake_.notify_all();
  drain();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [&] { return finished_ == workers_.size(); });
    err = error_;
    task_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace streamload
