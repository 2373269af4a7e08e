#include "cold_reader.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mapped_file.h"

namespace streamload {
namespace {

// Ranges this close share one read: the gap costs less than a second request
// (row slices of a column-sharded tensor are many short ranges with short gaps).
// Wider gaps are not read: on an MoE checkpoint the gap between one expert's
// gate/up and the next is its down projection (512 KiB at hidden 1024), which
// the next bucket reads, so reading it here read a third of every layer twice.
// Separate reads cost nothing on a disk with several in flight (measured here:
// 64 x 1 MiB O_DIRECT in flight 1.33 GB/s, 8 x 16 MiB 1.44 GB/s).
constexpr uint64_t kMaxGap = 64 << 10;

// Buffered: ranges of a window this long on average are read one by one straight
// into their destinations; shorter ones (row slices) share one read into a bounce.
constexpr uint64_t kOwnRead = 64 << 10;

// Files whose descriptors a reader keeps open between calls.
constexpr size_t kOpenFiles = 4;

// Bytes per POSIX_FADV_WILLNEED call (see ColdReader::read).
constexpr uint64_t kAdviseSlice = 512 << 10;

uint64_t align_down(uint64_t x) { return x / kDirectAlign * kDirectAlign; }
uint64_t align_up(uint64_t x) { return (x + kDirectAlign - 1) / kDirectAlign * kDirectAlign; }

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

// The descriptors one read uses: a buffered one always (fallback, fadvise),
// an O_DIRECT one where asked for and the file system accepts it.
struct Fds {
  int buffered = -1;
  int direct = -1;
  uint64_t size = 0;
  bool refused = false;
  // drop_behind: pages are dropped as soon as they are read, so the kernel must not
  // read ahead: a window's readahead landing in a neighbour's range after that range
  // was dropped would leave pages behind (seen under ASan's slower timing).
  Fds(const std::string& path, DirectMode mode, bool drop_behind = false) {
    buffered = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (buffered < 0) throw FileError(errno_text("cannot open"), path);
    struct stat st;
    if (::fstat(buffered, &st) != 0) {
      ::close(buffered);
      throw FileError(errno_text("cannot stat"), path);
    }
    size = static_cast<uint64_t>(st.st_size);
    // Buffered reads of an O_DIRECT reader that was refused go front to back: let the
    // kernel read ahead far, unless every page is dropped behind the reader (then no
    // readahead at all). A reader that reads buffered by choice advises RANDOM (open).
    ::posix_fadvise(buffered, 0, 0, drop_behind ? POSIX_FADV_RANDOM : POSIX_FADV_SEQUENTIAL);
    if (mode == DirectMode::Off) return;
    direct = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (direct < 0) {
      int err = errno;
      refused = true;
      if (mode == DirectMode::On) {
        ::close(buffered);
        errno = err;
        throw FileError(errno_text("O_DIRECT refused"), path);
      }
    }
  }
  ~Fds() {
    if (buffered >= 0) ::close(buffered);
    if (direct >= 0) ::close(direct);
  }
  Fds(const Fds&) = delete;
  Fds& operator=(const Fds&) = delete;
};

namespace {

// Reads until [0, need) of dst holds file bytes [offset, offset + need);
// asks for `len` >= need (O_DIRECT wants whole aligned blocks, and returns a
// short count at the end of the file). Returns bytes read, or -1 on EINVAL
// (O_DIRECT refused for this file or buffer) when `einval_ok`.
int64_t read_span(int fd, char* dst, uint64_t offset, uint64_t len, uint64_t need, bool einval_ok,
                  const std::string& path) {
  uint64_t got = 0;
  while (got < need) {
    ssize_t n = ::pread(fd, dst + got, len - got, static_cast<off_t>(offset + got));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL && einval_ok) return -1;
      throw FileError(errno_text("read failed"), path);
    }
    if (n == 0) throw FileError("unexpected end of file (was it truncated?)", path);
    got += static_cast<uint64_t>(n);
  }
  return static_cast<int64_t>(got);
}

struct Window {
  uint64_t begin, end;  // aligned file offsets; end <= align_up(file size)
};

}  // namespace

DirectMode parse_direct_mode(const std::string& s) {
  if (s == "off") return DirectMode::Off;
  if (s == "on") return DirectMode::On;
  if (s != "auto") throw std::invalid_argument("direct must be 'auto', 'on' or 'off', not '" + s + "'");
  return DirectMode::Auto;
}

std::pair<uint64_t, uint64_t> residency(const std::string& path, uint64_t offset, uint64_t length,
                                        uint64_t sample_pages) {
  Fds f(path, DirectMode::Off);
  if (offset >= f.size) return {0, 0};
  uint64_t end = length == 0 ? f.size : std::min(f.size, offset + std::min(length, f.size - offset));
  uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t lo = offset / page * page;
  uint64_t span = end - lo;
  uint64_t pages = (span + page - 1) / page;
  void* p = ::mmap(nullptr, span, PROT_READ, MAP_SHARED, f.buffered, static_cast<off_t>(lo));
  if (p == MAP_FAILED) throw FileError(errno_text("mmap failed"), path);
  // Every page, or (sampled) windows of kResidencyWindow pages spread evenly from the
  // first page to the last: the cost stays flat in the file's size.
  uint64_t window = pages;
  uint64_t windows = 1;
  if (sample_pages > 0 && pages > sample_pages) {
    window = std::min<uint64_t>(kResidencyWindow, sample_pages);
    windows = std::max<uint64_t>(sample_pages / window, 2);
    if (windows * window >= pages) {  // windows that would overlap: every page, once
      window = pages;
      windows = 1;
    }
  }
  std::vector<unsigned char> vec(window);
  uint64_t resident = 0, probed = 0;
  for (uint64_t i = 0; i < windows; ++i) {
    uint64_t first = windows == 1 ? 0 : i * (pages - window) / (windows - 1);
    uint64_t n = std::min(window, pages - first);
    uint64_t bytes = std::min(n * page, span - first * page);
    if (::mincore(static_cast<char*>(p) + first * page, bytes, vec.data()) != 0) {
      int err = errno;
      ::munmap(p, span);
      errno = err;
      throw FileError(errno_text("mincore failed"), path);
    }
    for (uint64_t k = 0; k < n; ++k) resident += vec[k] & 1;
    probed += n;
  }
  ::munmap(p, span);
  return {resident, probed};
}

void evict(const std::string& path, uint64_t offset, uint64_t length, bool sync) {
  Fds f(path, DirectMode::Off);
  if (sync && ::fdatasync(f.buffered) != 0) throw FileError(errno_text("fdatasync failed"), path);
  if (::posix_fadvise(f.buffered, static_cast<off_t>(offset), static_cast<off_t>(length), POSIX_FADV_DONTNEED) != 0)
    throw FileError("posix_fadvise(DONTNEED) failed", path);
}

ColdReader::Buffer::~Buffer() { std::free(p); }

ColdReader::ColdReader(size_t threads, uint64_t block_bytes, DirectMode direct, bool drop_behind,
                       bool refuse_direct_for_test)
    : pool_(threads ? threads : 8),
      block_(align_up(std::max<uint64_t>(block_bytes, kDirectAlign))),
      direct_(direct),
      drop_behind_(drop_behind),
      refuse_direct_(refuse_direct_for_test) {}

char* ColdReader::acquire() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!free_.empty()) {
    char* p = free_.back();
    free_.pop_back();
    return p;
  }
  auto b = std::make_unique<Buffer>();
  if (::posix_memalign(reinterpret_cast<void**>(&b->p), kDirectAlign, block_) != 0) throw std::bad_alloc();
  all_.push_back(std::move(b));
  return all_.back()->p;
}

void ColdReader::release(char* p) {
  std::lock_guard<std::mutex> lk(mu_);
  free_.push_back(p);
}

std::shared_ptr<Fds> ColdReader::open(const std::string& path, int expect_fd) {
  std::lock_guard<std::mutex> lk(mu_);
  // Kept open across calls: one open (two with O_DIRECT) per file, not per chunk. Only the
  // last few files: reads go through the files in order, and a checkpoint of hundreds of
  // files must not hold hundreds of descriptors per reader.
  auto it = std::find_if(fds_.begin(), fds_.end(), [&](const auto& e) { return e.first == path; });
  std::shared_ptr<Fds> f;
  if (it != fds_.end()) {
    f = it->second;
    fds_.erase(it);
  } else {
    f = std::make_shared<Fds>(path, direct_, drop_behind_);
    if (expect_fd >= 0) {
      // The header (offsets, sizes) came from expect_fd's file: read that one or none.
      struct stat want, got;
      if (::fstat(expect_fd, &want) != 0 || ::fstat(f->buffered, &got) != 0)
        throw FileError(errno_text("cannot stat"), path);
      if (want.st_dev != got.st_dev || want.st_ino != got.st_ino)
        throw FileError("the file was replaced after the checkpoint was opened: its header no longer describes it", path);
    }
    // A buffered reader asks for exactly its windows (WILLNEED, in read): the kernel's
    // own readahead would also read what lies between them, which on a rank that reads
    // every other slice of each tensor is the next rank's bytes.
    if (f->direct < 0) ::posix_fadvise(f->buffered, 0, 0, POSIX_FADV_RANDOM);
  }
  fds_.emplace_back(path, f);
  if (fds_.size() > kOpenFiles) fds_.erase(fds_.begin());  // a read still using it holds its own reference
  return f;
}

ReadStats ColdReader::read(const std::string& path, const std::vector<ReadRange>& ranges, int expect_fd) {
  auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<Fds> held = open(path, expect_fd);
  Fds& f = *held;
  ReadStats stats;
  stats.direct_refused = f.refused;
  // Validate everything before the first byte is written.
  uint64_t prev_end = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const ReadRange& r = ranges[i];
    std::string at = "read range " + std::to_string(i) + ": ";
    if (r.nbytes > r.dst_len) throw FileError(at + "destination is smaller than the read", path);
    if (r.offset > f.size || r.nbytes > f.size - r.offset)
      throw FileError(at + "bytes " + std::to_string(r.offset) + "+" + std::to_string(r.nbytes) +
                      " are past the end of the file (" + std::to_string(f.size) + " bytes)", path);
    if (r.nbytes > 0 && r.dst == nullptr) throw FileError(at + "null destination", path);
    if (r.nbytes == 0) continue;
    if (r.offset < prev_end) throw FileError(at + "ranges must be sorted by offset and not overlap", path);
    prev_end = r.offset + r.nbytes;
    stats.bytes_requested += r.nbytes;
  }
  std::vector<ReadRange> rs;
  for (const ReadRange& r : ranges)
    if (r.nbytes > 0) rs.push_back(r);
  // Windows of at most one block, aligned, in file order; near ranges share one.
  std::vector<Window> windows;
  for (const ReadRange& r : rs) {
    uint64_t s = r.offset, e = r.offset + r.nbytes;
    while (s < e) {
      Window* cur = windows.empty() ? nullptr : &windows.back();
      if (cur != nullptr && s < cur->end) {
        s = cur->end;
        continue;
      }
      uint64_t reach = cur ? std::min(align_up(e), cur->begin + block_) : 0;
      if (cur == nullptr || s >= cur->end + kMaxGap || reach <= s) {
        uint64_t b = align_down(s);
        windows.push_back({b, std::min(align_up(e), b + block_)});
      } else {
        cur->end = std::max(cur->end, reach);
      }
    }
  }
  std::atomic<bool> direct_ok{f.direct >= 0};
  std::atomic<bool> refused{f.refused};
  std::atomic<uint64_t> bytes{0}, direct_windows{0};
  auto drop = [&](uint64_t off, uint64_t len) {
    if (drop_behind_) ::posix_fadvise(f.buffered, static_cast<off_t>(off), static_cast<off_t>(len), POSIX_FADV_DONTNEED);
  };
  auto one = [&](size_t w) {
    const Window& win = windows[w];
    // The first range ending after the window's start (ends are increasing).
    auto first = std::partition_point(rs.begin(), rs.end(), [&](const ReadRange& r) { return r.offset + r.nbytes <= win.begin; });
    auto last = first;
    while (last != rs.end() && last->offset < win.end) ++last;
    uint64_t lo = std::max(win.begin, first->offset);
    uint64_t hi = std::min(win.end, (last - 1)->offset + (last - 1)->nbytes);
    bool single = last - first == 1;
    if (direct_ok.load()) {
      // A window inside one range whose destination is aligned needs no bounce.
      char* target = nullptr;
      // At the end of the file, a destination with room for the whole aligned
      // window qualifies too: the read stops at the end of the file.
      uint64_t r_end = first->offset + first->nbytes;
      if (single && first->offset <= win.begin &&
          (r_end >= win.end || (r_end == f.size && win.end - first->offset <= first->dst_len))) {
        char* d = first->dst + (win.begin - first->offset);
        if (reinterpret_cast<uintptr_t>(d) % kDirectAlign == 0) target = d;
      }
      char* bounce = target ? nullptr : acquire();
      int64_t got = -1;
      try {
        if (!refuse_direct_)
          got = read_span(f.direct, target ? target : bounce, win.begin, win.end - win.begin, hi - win.begin, true, path);
        if (got >= 0 && bounce != nullptr) {
          for (auto r = first; r != last; ++r) {
            uint64_t a = std::max(lo, r->offset), b = std::min(hi, r->offset + r->nbytes);
            std::memcpy(r->dst + (a - r->offset), bounce + (a - win.begin), b - a);
          }
        }
      } catch (...) {
        if (bounce) release(bounce);
        throw;
      }
      if (bounce) release(bounce);
      if (got >= 0) {
        bytes.fetch_add(static_cast<uint64_t>(got));
        direct_windows.fetch_add(1);
        drop(win.begin, win.end - win.begin);
        return;
      }
      // EINVAL: this file system (or this file) refuses O_DIRECT; buffered from now on.
      if (direct_ == DirectMode::On) throw FileError("O_DIRECT read refused (EINVAL)", path);
      direct_ok.store(false);
      refused.store(true);
    }
    // Buffered: exactly the bytes needed; one range, or ranges of kOwnRead bytes or more
    // on average, go straight to their destinations (one read each, no bounce copy).
    // Counted alike either way: the span from the first range to the last, gaps included,
    // which is what the kernel was asked for (WILLNEED) and read.
    if (single || (hi - lo) / static_cast<uint64_t>(last - first) >= kOwnRead) {
      for (auto r = first; r != last; ++r) {
        uint64_t a = std::max(lo, r->offset), b = std::min(hi, r->offset + r->nbytes);
        read_span(f.buffered, r->dst + (a - r->offset), a, b - a, b - a, false, path);
      }
      bytes.fetch_add(hi - lo);
    } else {
      char* bounce = acquire();
      try {
        read_span(f.buffered, bounce, lo, hi - lo, hi - lo, false, path);
        bytes.fetch_add(hi - lo);
        for (auto r = first; r != last; ++r) {
          uint64_t a = std::max(lo, r->offset), b = std::min(hi, r->offset + r->nbytes);
          std::memcpy(r->dst + (a - r->offset), bounce + (a - lo), b - a);
        }
      } catch (...) {
        release(bounce);
        throw;
      }
      release(bounce);
    }
    drop(lo, hi - lo);
  };
  if (f.direct >= 0) {
    pool_.run(windows.size(), one);
  } else {
    // Buffered: one thread in file order. Several threads on one descriptor got small
    // reads (measured: 1 stream 2-3 GB/s, 2-8 threads 1.1 GB/s on a virtio disk).
    // Every window is requested up front, then copied out in file order as its pages
    // arrive. In slices: the kernel caps one WILLNEED at max(io_pages, ra_pages) (128 KiB
    // to a few MiB), and drops the rest of a larger one silently.
    for (const Window& win : windows)
      for (uint64_t at = win.begin; at < win.end; at += kAdviseSlice)
        ::posix_fadvise(f.buffered, static_cast<off_t>(at), static_cast<off_t>(std::min(kAdviseSlice, win.end - at)),
                        POSIX_FADV_WILLNEED);
    for (size_t w = 0; w < windows.size(); ++w) one(w);
  }
  // Once more over everything read, after every window finished: a page one window's
  // read brought in after its neighbour dropped its range goes too.
  if (!windows.empty()) drop(windows.front().begin, windows.back().end - windows.front().begin);
  stats.bytes_read = bytes.load();
  stats.windows = windows.size();
  stats.direct_windows = direct_windows.load();
  stats.direct_refused = refused.load();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

ReadStats ColdReader::prefetch(const std::string& path, std::vector<std::pair<uint64_t, uint64_t>> ranges) {
  auto t0 = std::chrono::steady_clock::now();
  Fds f(path, DirectMode::Off);
  ReadStats stats;
  for (const auto& r : ranges)
    if (r.first > f.size || r.second > f.size - r.first)
      throw FileError("prefetch range past the end of the file", path);
  std::sort(ranges.begin(), ranges.end());
  std::vector<Window> windows;  // merged, then cut into blocks
  for (const auto& r : ranges) {
    if (r.second == 0) continue;
    stats.bytes_requested += r.second;
    uint64_t s = r.first, e = r.first + r.second;
    if (!windows.empty() && s <= windows.back().end) s = std::max(s, windows.back().end);
    for (; s < e; s += block_) {
      uint64_t end = std::min(e, s + block_);
      if (!windows.empty() && windows.back().end == s && end - windows.back().begin <= block_)
        windows.back().end = end;
      else
        windows.push_back({s, end});
    }
  }
  std::atomic<uint64_t> bytes{0};
  pool_.run(windows.size(), [&](size_t w) {
    char* buf = acquire();
    try {
      uint64_t n = windows[w].end - windows[w].begin;
      bytes.fetch_add(static_cast<uint64_t>(read_span(f.buffered, buf, windows[w].begin, n, n, false, path)));
    } catch (...) {
      release(buf);
      throw;
    }
    release(buf);
  });
  stats.bytes_read = bytes.load();
  stats.windows = windows.size();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

ReadStats ColdReader::probe(const std::vector<std::string>& paths) {
  std::vector<std::unique_ptr<Fds>> files;
  for (const auto& p : paths) files.push_back(std::make_unique<Fds>(p, direct_));
  struct Block {
    size_t file;
    uint64_t offset;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < files.size(); ++i)
    for (uint64_t o = 0; o < files[i]->size; o += block_) blocks.push_back({i, o});
  ReadStats stats;
  for (size_t i = 0; i < files.size(); ++i) {
    stats.bytes_requested += files[i]->size;
    stats.direct_refused = stats.direct_refused || files[i]->refused;
    // Buffered reads would measure the page cache unless the pages are gone.
    if (files[i]->direct < 0 || refuse_direct_) evict(paths[i], 0, 0, true);
  }
  std::atomic<bool> direct_ok{!refuse_direct_};
  std::atomic<bool> refused{stats.direct_refused || refuse_direct_};
  std::atomic<uint64_t> bytes{0}, direct_windows{0};
  auto t0 = std::chrono::steady_clock::now();
  pool_.run(blocks.size(), [&](size_t k) {
    const Fds& f = *files[blocks[k].file];
    const std::string& path = paths[blocks[k].file];
    uint64_t off = blocks[k].offset, need = std::min(block_, f.size - off);
    char* buf = acquire();
    try {
      int64_t got = -1;
      if (f.direct >= 0 && direct_ok.load()) {
        got = read_span(f.direct, buf, off, align_up(need), need, true, path);
        if (got < 0) {
          // Refused late (EINVAL): evicting now keeps the buffered rest honest.
          direct_ok.store(false);
          refused.store(true);
          ::posix_fadvise(f.buffered, 0, 0, POSIX_FADV_DONTNEED);
        } else {
          direct_windows.fetch_add(1);
        }
      }
      if (got < 0) {
        got = read_span(f.buffered, buf, off, need, need, false, path);
        ::posix_fadvise(f.buffered, static_cast<off_t>(off), static_cast<off_t>(need), POSIX_FADV_DONTNEED);
      }
      bytes.fetch_add(static_cast<uint64_t>(got));
    } catch (...) {
      release(buf);
      throw;
    }
    release(buf);
  });
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stats.bytes_read = bytes.load();
  stats.windows = blocks.size();
  stats.direct_windows = direct_windows.load();
  stats.direct_refused = refused.load();
  return stats;
}

}  // namespace streamload
