// Cold reads: files that are not in the page cache, read at the disk's speed.
// Reading through a mapping faults one page (or one readahead window) at a
// time; here large aligned preads, several in flight, read byte ranges of a
// file in file order into caller memory, with O_DIRECT and an aligned bounce
// buffer where the file system allows it; buffered (where it does not, or when
// asked) every window is requested up front with POSIX_FADV_WILLNEED and copied
// out in file order. Also: page-cache residency
// (mincore), eviction (POSIX_FADV_DONTNEED) and a sequential-read bandwidth
// probe, which the loader and the benchmark use to choose and to compare.
#pragma once

#include <cstdint>
#include <utility>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "thread_pool.h"

namespace streamload {

// O_DIRECT needs file offset, length and buffer aligned to the logical block
// size; 4096 covers every block size in use.
constexpr uint64_t kDirectAlign = 4096;

enum class DirectMode { Auto = 0, Off = 1, On = 2 };

// One read: [offset, offset + nbytes) of the file (absolute file offsets)
// into dst, which has dst_len writable bytes.
struct ReadRange {
  uint64_t offset;
  uint64_t nbytes;
  char* dst;
  uint64_t dst_len;
};

struct ReadStats {
  uint64_t bytes_requested = 0;  // sum of the ranges' lengths
  uint64_t bytes_read = 0;       // bytes the windows read (O_DIRECT: aligned; buffered: first range to last, short gaps included)
  uint64_t windows = 0;          // windows read, large and aligned (a buffered one: one pread, or one per range of 64 KiB+)
  uint64_t direct_windows = 0;   // of which with O_DIRECT
  bool direct_refused = false;   // open(O_DIRECT) or a direct read failed with EINVAL
  double seconds = 0;
};

// Pages of [offset, offset + length) of the file in the page cache (length 0:
// to the end). Returns {resident pages, pages probed}: every page, or with
// sample_pages > 0 and a longer range, about that many pages in windows of
// kResidencyWindow spread evenly over the range (first and last included).
constexpr uint64_t kResidencyWindow = 16;
std::pair<uint64_t, uint64_t> residency(const std::string& path, uint64_t offset, uint64_t length,
                                        uint64_t sample_pages = 0);

// Drops the file's pages in [offset, offset + length) from the page cache
// (length 0: to the end). `sync` first writes back dirty pages (a file just
// written is dirty, and DONTNEED leaves dirty pages in place).
void evict(const std::string& path, uint64_t offset, uint64_t length, bool sync);

struct Fds;  // a file's descriptors (cold_reader.cpp)

class ColdReader {
 public:
  // threads: preads in flight (0: 8; they wait on the disk, not the CPU).
  // block_bytes: the size of one read (rounded up to kDirectAlign). drop_behind: DONTNEED each window once
  // consumed, so the checkpoint does not stay in the page cache.
  // refuse_direct_for_test: every O_DIRECT read fails with EINVAL, as on a file system that
  // refuses it, so that tests reach the buffered fallback on any file system.
  ColdReader(size_t threads, uint64_t block_bytes, DirectMode direct, bool drop_behind,
             bool refuse_direct_for_test = false);

  size_t threads() const { return pool_.size(); }
  uint64_t block_bytes() const { return block_; }

  // Reads every range (sorted by offset, not overlapping, inside the file,
  // each nbytes <= dst_len: checked before anything is read). Ranges closer
  // than 64 KiB share a read. A window inside one range whose destination is
  // aligned like its file offset is read straight into place (no bounce);
  // callers that lay out their buffers so get O_DIRECT without a copy.
  // Throws FileError.
  // expect_fd >= 0: a descriptor of the file the caller read the header from; a path that
  // now names another file (replaced since) is a FileError, never a mix of two files' bytes.
  ReadStats read(const std::string& path, const std::vector<ReadRange>& ranges, int expect_fd = -1);

  // Reads the ranges ({offset, nbytes}, in the file) through the page cache,
  // several in flight, and discards the bytes: afterwards they are cached, so
  // a mapping of them reads nothing from disk. Never drops behind.
  ReadStats prefetch(const std::string& path, std::vector<std::pair<uint64_t, uint64_t>> ranges);

  // Reads the whole of every file once, in file order, into the bounce
  // buffers and discards it: the disk's sequential read bandwidth. Without
  // O_DIRECT the files are evicted first (else this measures the page cache).
  ReadStats probe(const std::vector<std::string>& paths);

 private:
  struct Buffer {
    char* p = nullptr;
    ~Buffer();
  };
  char* acquire();
  void release(char* p);
  std::shared_ptr<Fds> open(const std::string& path, int expect_fd);

  ThreadPool pool_;
  uint64_t block_;
  DirectMode direct_;
  bool drop_behind_;
  bool refuse_direct_;  // direct reads fail as on a file system that refuses O_DIRECT (tests)
  std::mutex mu_;
  std::vector<std::unique_ptr<Buffer>> all_;
  std::vector<char*> free_;
  std::vector<std::pair<std::string, std::shared_ptr<Fds>>> fds_;  // the last files read, oldest first
};

// DirectMode from "auto" | "off" | "on" (the caller decides; nothing here reads the environment).
DirectMode parse_direct_mode(const std::string& s);

}  // namespace streamload
