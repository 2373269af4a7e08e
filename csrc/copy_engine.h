// Batches of copy ops: each copies an N-d strided region of a source tensor
// (in a mapped/pread file, or in memory) into a destination buffer, casting
// the element type on the way. Every op is bounds-checked before anything is
// written, so a bad batch writes nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mapped_file.h"
#include "thread_pool.h"

namespace streamload {

// Work is split so that each piece moves about this many destination bytes:
// large enough to amortise dispatch, small enough to balance two cores. The
// copy engine and the dequant ops split alike.
constexpr int64_t kPieceBytes = 4 << 20;

// Outer indices per piece when one index moves ``row_bytes`` destination bytes.
inline int64_t piece_rows(int64_t row_bytes) {
  int64_t n = kPieceBytes / (row_bytes > 1 ? row_bytes : 1);
  return n > 1 ? n : 1;
}

constexpr int kMaxDims = 8;

// One op as it crosses the boundary: a row of int64 in a (n, kOpFields) array.
struct CopyOp {
  int64_t file;        // index into the batch's files, or -1: `src` is an address
  int64_t src;         // byte offset of the source tensor in the file's data section, or address
  int64_t src_nbytes;  // bytes of the source tensor (the read bound)
  int64_t src_dtype;
  int64_t dst;         // destination address
  int64_t dst_nbytes;  // bytes writable at dst (the write bound)
  int64_t dst_dtype;
  int64_t ndim;
  int64_t src_offset;  // element offset of the region in the source tensor
  int64_t dst_offset;  // element offset of the region at dst
  int64_t shape[kMaxDims];
  int64_t src_stride[kMaxDims];  // in elements
  int64_t dst_stride[kMaxDims];  // in elements
};
constexpr int kOpFields = sizeof(CopyOp) / sizeof(int64_t);
static_assert(kOpFields == 34, "CopyOp layout is part of the Python contract");

class CopyError : public std::runtime_error {
 public:
  CopyError(const std::string& what, int64_t op) : std::runtime_error(what), op(op) {}
  int64_t op;
};

class CopyEngine {
 public:
  explicit CopyEngine(size_t threads);
  size_t threads() const { return pool_.size(); }
  // The workers, shared with the other ops this engine runs (dequantization).
  ThreadPool& pool() { return pool_; }

  // Validates every op, then executes them all; returns bytes read.
  uint64_t execute(const std::vector<const MappedFile*>& files, const CopyOp* ops, size_t n);

  // Plain std::memcpy split into one contiguous chunk per thread: the
  // baseline benchmarks compare against.
  void parallel_memcpy(char* dst, const char* src, size_t n);

  // The largest pread bounce read so far (bytes): what one worker's buffer holds.
  uint64_t peak_bounce_bytes() const { return peak_bounce_.load(); }

  // Whether each piece's destination pages are faulted in by one madvise before
  // its copy (see populate_pages); on by default.
  bool populate() const { return populate_.load(std::memory_order_relaxed); }
  void set_populate(bool on) { populate_.store(on, std::memory_order_relaxed); }

 private:
  ThreadPool pool_;
  std::atomic<uint64_t> peak_bounce_{0};
  std::atomic<bool> populate_{true};
};

// Pieces whose destination spans less than this are left to fault as they are written.
constexpr int64_t kPopulateMinBytes = 64 << 10;

// Faults in the whole pages of [dst, dst + nbytes) writable, in one
// madvise(MADV_POPULATE_WRITE) call, without changing a byte. A page that a
// copy would fault in on first write costs a trap per 4 KiB page; in one call
// the kernel takes them back to back (`python benchmarks/bench_first_touch.py`
// measures the engine both ways). Only for memory about to be written: a page
// of a private file mapping becomes a private copy, as the write would make it.
// Returns false where the kernel lacks it (before Linux 5.14, asked once) or
// refuses this range; the copy's writes then fault the pages as before.
bool populate_pages(char* dst, size_t nbytes);

// populate_pages for a piece that spans `span_bytes` from dst and writes `written_bytes` of
// them, when it is worth it: at least kPopulateMinBytes, and dense (it writes at least half
// of what it spans; a sparse piece, a column of wide rows, leaves its pages to others).
void populate_dense(char* dst, int64_t span_bytes, int64_t written_bytes);

// Installs the SIGBUS handler that run_guarded relies on (idempotent).
void install_bus_handler();

// Runs body() reading from mapping f; a SIGBUS raised because the file was
// truncated while mapped becomes a FileError instead of killing the process.
// body must own no resources that need destructors (it is jumped out of).
void run_guarded(const MappedFile* f, const std::function<void()>& body);

// Threads to use when the caller does not say: the CPUs this process may run on.
size_t default_threads();

}  // namespace streamload
