#include "thread_pool.h"

#include <pthread.h>

#include <unordered_set>

namespace streamload {

namespace {

// Every live pool, so the fork child handler can reset them. Leaked on
// purpose: a pool may be destroyed after static destructors have run.
struct Registry {
  std::mutex mu;
  std::unordered_set<ThreadPool*> pools;
};

Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

}  // namespace

void ThreadPool::atfork_prepare() { registry().mu.lock(); }  // no pool is added or removed across fork
void ThreadPool::atfork_parent() { registry().mu.unlock(); }

void ThreadPool::atfork_child() {
  // The child has one thread here (the forking one, which holds the lock).
  for (ThreadPool* p : registry().pools) p->reset_in_child();
  registry().mu.unlock();
}

void ThreadPool::register_pool(ThreadPool* pool, bool add) {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(&atfork_prepare, &atfork_parent, &atfork_child); });
  std::lock_guard<std::mutex> lk(registry().mu);
  if (add)
    registry().pools.insert(pool);
  else
    registry().pools.erase(pool);
}

ThreadPool::ThreadPool(size_t threads) : threads_(threads ? threads : 1) {
  st_ = std::make_unique<State>();
  register_pool(this, true);
  start();
}

void ThreadPool::start() {
  // Under the registry lock: a fork never sees workers_ half-written.
  std::lock_guard<std::mutex> lk(registry().mu);
  State* st = st_.get();
  for (size_t i = 1; i < threads_; ++i) workers_.emplace_back([st] { worker_loop(st); });
}

void ThreadPool::reset_in_child() {
  // The parent's threads do not exist here: joining them would wait forever
  // and destroying a joinable std::thread aborts, so their handles are
  // leaked on purpose, and so is the state (its mutexes may be locked by a
  // thread that is gone).
  new std::vector<std::thread>(std::move(workers_));
  workers_.clear();
  (void)st_.release();
  st_ = std::make_unique<State>();
  need_start_ = true;
}

ThreadPool::~ThreadPool() {
  register_pool(this, false);
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
  State* st = st_.get();
  std::lock_guard<std::mutex> run_lock(st->run_mu);
  if (need_start_) {  // first run in a forked child: under the run lock, so once
    start();
    need_start_ = false;
  }
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
