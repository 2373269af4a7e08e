#include "thread_pool.h"

#include <unistd.h>

namespace streamload {

ThreadPool::ThreadPool(size_t threads) : threads_(threads ? threads : 1), pid_(getpid()) { start(); }

void ThreadPool::start() {
  st_ = std::make_unique<State>();
  workers_.clear();
  State* st = st_.get();
  for (size_t i = 1; i < threads_; ++i) workers_.emplace_back([st] { worker_loop(st); });
}

void ThreadPool::after_fork() {
  // The parent's threads do not exist here: joining them would wait forever
  // and destroying a joinable std::thread aborts, so their handles are
  // leaked on purpose, and so is the state (its mutexes may be locked by a
  // thread that is gone).
  new std::vector<std::thread>(std::move(workers_));
  (void)st_.release();
  pid_ = getpid();
  start();
}

ThreadPool::~ThreadPool() {
  if (getpid() != pid_) {
    // A child that never ran: the workers belong to the parent.
    new std::vector<std::thread>(std::move(workers_));
    (void)st_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lk(st_->mu);
    st_->stop = true;
  }
  st_->wake.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::drain(State* st) {
  for (;;) {
    size_t i = st->next.fetch_add(1);
    if (i >= st->n) return;
    try {
      (*st->task)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lk(st->mu);
      if (!st->error) st->error = std::current_exception();
      st->next.store(st->n);  // stop handing out work after the first failure
    }
  }
}

void ThreadPool::worker_loop(State* st) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(st->mu);
      st->wake.wait(lk, [&] { return st->stop || st->generation != seen; });
      if (st->stop) return;
      seen = st->generation;
    }
    drain(st);
    {
      std::lock_guard<std::mutex> lk(st->mu);
      ++st->finished;
    }
    st->done.notify_all();
  }
}

void ThreadPool::run(size_t n, const std::function<void(size_t)>& task) {
  if (n == 0) return;
  if (getpid() != pid_) after_fork();
  State* st = st_.get();
  std::lock_guard<std::mutex> run_lock(st->run_mu);
  {
    std::lock_guard<std::mutex> lk(st->mu);
    st->task = &task;
    st->n = n;
    st->next.store(0);
    st->error = nullptr;
    st->finished = 0;
    ++st->generation;
  }
  // Every worker takes part in every generation, so none is left running
  // with a stale task when run() returns.
  st->wake.notify_all();
  drain(st);
  std::exception_ptr err;
  const size_t workers = workers_.size();
  {
    std::unique_lock<std::mutex> lk(st->mu);
    st->done.wait(lk, [&] { return st->finished == workers; });
    err = st->error;
    st->task = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace streamload
