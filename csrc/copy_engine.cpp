#include "copy_engine.h"

#include <algorithm>
#include <cstring>

#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // linux/mman.h, Linux >= 5.14
#endif

#include <atomic>
#include <mutex>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define STREAMLOAD_HAVE_SSE2 1
#endif

#include "dtype.h"

namespace streamload {
namespace {

// Regions after merging dims that are contiguous in both source and dest.
struct Region {
  int ndim;
  int64_t shape[kMaxDims], ss[kMaxDims], ds[kMaxDims];
};

Region coalesce(const CopyOp& op) {
  Region r{};
  r.ndim = 0;
  for (int i = 0; i < op.ndim; ++i) {
    if (op.shape[i] == 1) continue;  // size-1 dims carry no stride information
    if (r.ndim > 0) {
      int j = r.ndim - 1;
      if (r.ss[j] == op.shape[i] * op.src_stride[i] && r.ds[j] == op.shape[i] * op.dst_stride[i]) {
        r.shape[j] *= op.shape[i];
        r.ss[j] = op.src_stride[i];
        r.ds[j] = op.dst_stride[i];
        continue;
      }
    }
    r.shape[r.ndim] = op.shape[i];
    r.ss[r.ndim] = op.src_stride[i];
    r.ds[r.ndim] = op.dst_stride[i];
    ++r.ndim;
  }
  if (r.ndim == 0) {  // a single element
    r.ndim = 1;
    r.shape[0] = 1;
    r.ss[0] = 1;
    r.ds[0] = 1;
  }
  return r;
}

int64_t numel(const CopyOp& op) {
  int64_t n = 1;
  for (int i = 0; i < op.ndim; ++i) n *= op.shape[i];
  return n;
}

// [lo, hi] element extents reached from `offset` (inclusive); requires numel > 0.
void extent(const CopyOp& op, bool src, int64_t* lo, int64_t* hi) {
  int64_t l = src ? op.src_offset : op.dst_offset, h = l;
  for (int i = 0; i < op.ndim; ++i) {
    int64_t st = src ? op.src_stride[i] : op.dst_stride[i];
    int64_t span = (op.shape[i] - 1) * st;
    if (span < 0) l += span; else h += span;
  }
  *lo = l;
  *hi = h;
}

void validate(const CopyOp& op, size_t idx, size_t nfiles, const std::vector<const MappedFile*>& files) {
  auto bad = [&](const std::string& why) { return CopyError("copy op " + std::to_string(idx) + ": " + why, static_cast<int64_t>(idx)); };
  if (op.ndim < 0 || op.ndim > kMaxDims) throw bad("ndim out of range");
  if (op.src_dtype < 0 || op.src_dtype >= static_cast<int64_t>(DType::COUNT) || op.dst_dtype < 0 ||
      op.dst_dtype >= static_cast<int64_t>(DType::COUNT))
    throw bad("unknown dtype");
  DType sd = static_cast<DType>(op.src_dtype), dd = static_cast<DType>(op.dst_dtype);
  if (!conversion_supported(sd, dd))
    throw bad(std::string("no conversion from ") + dtype_name(sd) + " to " + dtype_name(dd));
  for (int i = 0; i < op.ndim; ++i)
    if (op.shape[i] < 0) throw bad("negative shape");
  if (op.src_nbytes < 0 || op.dst_nbytes < 0) throw bad("negative length");
  if (op.file >= 0) {
    if (static_cast<size_t>(op.file) >= nfiles) throw bad("file index out of range");
    const Header& h = files[static_cast<size_t>(op.file)]->header();
    if (op.src < 0 || static_cast<uint64_t>(op.src) > h.data_size ||
        static_cast<uint64_t>(op.src_nbytes) > h.data_size - static_cast<uint64_t>(op.src))
      throw bad("source tensor is outside the file's data section");
  } else if (op.file != -1) {
    throw bad("bad file index");
  }
  if (numel(op) == 0) return;
  if (op.dst == 0 || (op.file == -1 && op.src == 0)) throw bad("null pointer");
  int64_t lo, hi;
  extent(op, true, &lo, &hi);
  int64_t si = static_cast<int64_t>(dtype_itemsize(sd)), di = static_cast<int64_t>(dtype_itemsize(dd));
  if (lo < 0 || (hi + 1) * si > op.src_nbytes) throw bad("region reads outside the source tensor");
  extent(op, false, &lo, &hi);
  if (lo < 0 || (hi + 1) * di > op.dst_nbytes) throw bad("region writes outside the destination buffer");
}

// Sub-byte dtypes (F4, F6_*) are copied as bytes: the innermost dim must be
// contiguous on both sides and every offset, stride and row a whole number
// of bytes. Returns the op rewritten over U8, or throws for a region that
// starts or ends inside a byte.
CopyOp as_bytes(const CopyOp& op, size_t idx) {
  DType d = static_cast<DType>(op.src_dtype);
  const int64_t bits = static_cast<int64_t>(dtype_bits(d));
  auto bad = [&](const std::string& why) {
    return CopyError("copy op " + std::to_string(idx) + ": " + dtype_name(d) + " is " +
                     std::to_string(bits) + "-bit and is copied as bytes: " + why, static_cast<int64_t>(idx));
  };
  CopyOp out = op;
  out.src_dtype = out.dst_dtype = static_cast<int64_t>(DType::U8);
  if (numel(op) == 0) return out;
  if (op.ndim == 0) throw bad("a single element is not a whole byte");
  auto whole = [&](int64_t elems, const char* what) {
    if ((elems * bits) % 8 != 0) throw bad(std::string(what) + " is not byte-aligned");
    return elems * bits / 8;
  };
  int last = op.ndim - 1;
  if (op.shape[last] > 1 && (op.src_stride[last] != 1 || op.dst_stride[last] != 1))
    throw bad("the innermost dim must be contiguous");
  out.shape[last] = whole(op.shape[last], "the innermost extent");
  out.src_stride[last] = out.dst_stride[last] = 1;
  for (int i = 0; i < last; ++i) {
    out.src_stride[i] = op.shape[i] == 1 ? 0 : whole(op.src_stride[i], "a source stride");
    out.dst_stride[i] = op.shape[i] == 1 ? 0 : whole(op.dst_stride[i], "a destination stride");
  }
  out.src_offset = whole(op.src_offset, "the source offset");
  out.dst_offset = whole(op.dst_offset, "the destination offset");
  return out;
}

template <typename S, typename D, typename F>
inline void run_loop(const char* s, char* d, int64_t n, int64_t ss, int64_t ds, F cvt) {
  const S* sp = reinterpret_cast<const S*>(s);
  D* dp = reinterpret_cast<D*>(d);
  if (ss == 1 && ds == 1) {
    for (int64_t i = 0; i < n; ++i) { S v; std::memcpy(&v, sp + i, sizeof(S)); D o = cvt(v); std::memcpy(dp + i, &o, sizeof(D)); }
  } else {
    for (int64_t i = 0; i < n; ++i) { S v; std::memcpy(&v, sp + i * ss, sizeof(S)); D o = cvt(v); std::memcpy(dp + i * ds, &o, sizeof(D)); }
  }
}

// Reads one element of a float-family dtype as float (f64 keeps double
// precision until the final narrowing, as torch's casts do).
inline double load_f(DType t, const char* p) {
  switch (t) {
    case DType::F16: { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); }
    case DType::BF16: { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_f32(h); }
    case DType::F32: { float f; std::memcpy(&f, p, 4); return f; }
    default: { double f; std::memcpy(&f, p, 8); return f; }
  }
}

inline void store_f(DType t, char* p, double v) {
  switch (t) {
    // Through f32 (x86 quiets and truncates a NaN's payload), then as torch's F16C cast.
    case DType::F16: { uint16_t h = f32_to_f16_keep_nan(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
    case DType::BF16: { uint16_t h = f32_to_bf16(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
    case DType::F32: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
    default: std::memcpy(p, &v, 8);
  }
}

// Above this size a run is copied with non-temporal stores: the destination
// is not read first (no read-for-ownership), which cuts memory traffic by a
// third. glibc only switches to such stores above ~3/4 of the L3 size per
// copy (240 MB here), far above the pieces a load moves.
constexpr size_t kStreamBytes = 256 << 10;

void stream_copy(char* d, const char* s, size_t n) {
#ifdef STREAMLOAD_HAVE_SSE2
  if (n >= kStreamBytes) {
    size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; ++i) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
      s += 64;
      d += 64;
    }
    // Streaming stores are weakly ordered: fence before anyone reads them.
    _mm_sfence();
    n -= blocks * 64;
  }
#endif
  std::memcpy(d, s, n);
}

// fp8 widens exactly to f32; narrower targets then round from that f32 with
// torch's NaN conventions (see f8_to_bf16, f32_to_f16_keep_nan).
void fp8_run(DType sd, DType dd, const char* s, char* d, int64_t n, int64_t ss, int64_t ds) {
  auto wide = sd == DType::F8_E4M3 ? f8e4m3_to_f32 : f8e5m2_to_f32;
  switch (dd) {
    case DType::BF16:
      return run_loop<uint8_t, uint16_t>(s, d, n, ss, ds, [&](uint8_t v) { return f8_to_bf16(wide(v)); });
    case DType::F16:
      return run_loop<uint8_t, uint16_t>(s, d, n, ss, ds, [&](uint8_t v) { return f32_to_f16_keep_nan(wide(v)); });
    case DType::F32: return run_loop<uint8_t, float>(s, d, n, ss, ds, wide);
    default:
      return run_loop<uint8_t, double>(s, d, n, ss, ds, [&](uint8_t v) { return static_cast<double>(wide(v)); });
  }
}

// Copies one contiguous-or-strided run of n elements.
void copy_run(DType sd, DType dd, const char* s, char* d, int64_t n, int64_t ss, int64_t ds) {
  if (sd == dd && ss == 1 && ds == 1) {
    stream_copy(d, s, static_cast<size_t>(n) * dtype_itemsize(sd));
    return;
  }
  if (sd == dd) {
    size_t isz = dtype_itemsize(sd);
    for (int64_t i = 0; i < n; ++i) std::memcpy(d + i * ds * isz, s + i * ss * isz, isz);
    return;
  }
  // Hot casts get typed loops the compiler can vectorise.
  if (sd == DType::BF16 && dd == DType::F32) return run_loop<uint16_t, float>(s, d, n, ss, ds, bf16_to_f32);
  if (sd == DType::F16 && dd == DType::F32) return run_loop<uint16_t, float>(s, d, n, ss, ds, f16_to_f32);
  if (sd == DType::F32 && dd == DType::BF16) return run_loop<float, uint16_t>(s, d, n, ss, ds, f32_to_bf16);
  if (sd == DType::F32 && dd == DType::F16) return run_loop<float, uint16_t>(s, d, n, ss, ds, f32_to_f16_keep_nan);
  if (sd == DType::F16 && dd == DType::BF16) return run_loop<uint16_t, uint16_t>(s, d, n, ss, ds, f16_to_bf16);
  // fp8 widens exactly to f32; bf16/f16 then round from that f32 as c10's
  // static_cast chain does.
  if (sd == DType::F8_E4M3 || sd == DType::F8_E5M2) return fp8_run(sd, dd, s, d, n, ss, ds);
  size_t si = dtype_itemsize(sd), di = dtype_itemsize(dd);
  for (int64_t i = 0; i < n; ++i) store_f(dd, d + i * ds * di, load_f(sd, s + i * ss * si));
}

// Walks a coalesced region; the innermost dim is one run.
void copy_region(DType sd, DType dd, const char* s, char* d, const Region& r) {
  size_t si = dtype_itemsize(sd), di = dtype_itemsize(dd);
  int inner = r.ndim - 1;
  int64_t idx[kMaxDims] = {0};
  for (;;) {
    int64_t so = 0, dof = 0;
    for (int i = 0; i < inner; ++i) { so += idx[i] * r.ss[i]; dof += idx[i] * r.ds[i]; }
    copy_run(sd, dd, s + so * static_cast<int64_t>(si), d + dof * static_cast<int64_t>(di), r.shape[inner], r.ss[inner], r.ds[inner]);
    int i = inner - 1;
    while (i >= 0 && ++idx[i] == r.shape[i]) { idx[i] = 0; --i; }
    if (i < 0) return;
  }
}

// A file truncated while mapped turns reads past its new end into SIGBUS.
// Copies from mappings run under a per-thread jump buffer: the handler jumps
// back and the copy fails with a FileError instead of killing the process.
// Faults that are not ours go to the previously installed handler.
thread_local sigjmp_buf* tl_bus_jump = nullptr;
struct sigaction g_previous_bus;

void bus_handler(int sig, siginfo_t* info, void* ctx) {
  if (tl_bus_jump != nullptr) siglongjmp(*tl_bus_jump, 1);
  if (g_previous_bus.sa_flags & SA_SIGINFO) {
    if (g_previous_bus.sa_sigaction) return g_previous_bus.sa_sigaction(sig, info, ctx);
  } else if (g_previous_bus.sa_handler != SIG_IGN && g_previous_bus.sa_handler != SIG_DFL) {
    return g_previous_bus.sa_handler(sig);
  }
  signal(SIGBUS, SIG_DFL);
  raise(SIGBUS);
}

}  // namespace

// (Re)installs the handler when someone else (faulthandler, say) took SIGBUS
// since; theirs is kept and chained for faults outside our copies.
void install_bus_handler() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lk(mu);
  struct sigaction current;
  if (sigaction(SIGBUS, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == bus_handler) return;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = bus_handler;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous_bus);
}

void run_guarded(const MappedFile* f, const std::function<void()>& body) {
  sigjmp_buf jump;
  if (sigsetjmp(jump, 0) != 0) {
    tl_bus_jump = nullptr;
    throw FileError("bus error reading the mapped file: it was truncated or replaced while loading", f->path());
  }
  tl_bus_jump = &jump;
  body();
  tl_bus_jump = nullptr;
}

namespace {

// Runs copy_region from a mapping; a SIGBUS becomes a FileError.
void guarded_copy(DType sd, DType dd, const char* s, char* d, const Region& r, const MappedFile* f) {
  run_guarded(f, [&] { copy_region(sd, dd, s, d, r); });
}

struct Piece {
  size_t op;
  Region region;
  int64_t src_offset, dst_offset;  // elements
};

// Populates the pages a piece writes (populate_dense) from its coalesced region.
void populate_piece(char* dst, const Region& r, int64_t di) {
  int64_t span = 1, written = 1;
  for (int k = 0; k < r.ndim; ++k) {
    if (r.ds[k] < 0 || r.shape[k] <= 0) return;
    span += (r.shape[k] - 1) * r.ds[k];
    written *= r.shape[k];
  }
  populate_dense(dst, span * di, written * di);
}

// A pread piece's bounce buffer never holds more than this: the rows of a column shard lie
// world-size times their length apart in the file, so a piece's whole span grows with the world.
constexpr int64_t kBounceBytes = 2 * kPieceBytes;

void note_peak(std::atomic<uint64_t>& peak, uint64_t n) {
  uint64_t seen = peak.load(std::memory_order_relaxed);
  while (seen < n && !peak.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
}

// Reads region r of a pread file (its element 0 at byte `at` of the data section) into dst
// through `buf`. A span that is at most half gaps and fits kBounceBytes is read whole (a 1-D
// strided gather whatever its gaps: there is no finer range to read); a sparser region one
// outer index at a time (each row of a column shard is its own range); a wider one in outer
// chunks whose span fits. So `buf` stays within kBounceBytes and gaps are read only where
// they are smaller than the data around them.
void pread_region(const MappedFile* f, DType sd, DType dd, int64_t at, char* dst, Region r,
                  std::vector<char>& buf, std::atomic<uint64_t>& peak) {
  const int64_t si = static_cast<int64_t>(dtype_itemsize(sd)), di = static_cast<int64_t>(dtype_itemsize(dd));
  while (r.ndim > 1 && r.shape[0] == 1) {  // a size-1 outer dim carries no range of its own
    for (int k = 1; k < r.ndim; ++k) {
      r.shape[k - 1] = r.shape[k];
      r.ss[k - 1] = r.ss[k];
      r.ds[k - 1] = r.ds[k];
    }
    --r.ndim;
  }
  int64_t lo = 0, hi = 0, n = 1, inner_lo = 0, inner_hi = 0;
  for (int k = 0; k < r.ndim; ++k) {
    int64_t span = (r.shape[k] - 1) * r.ss[k];
    if (span < 0) lo += span; else hi += span;
    if (k > 0) {
      if (span < 0) inner_lo += span; else inner_hi += span;
    }
    n *= r.shape[k];
  }
  const int64_t len = (hi - lo + 1) * si;
  const bool dense = len <= 2 * n * si;
  if (len <= kBounceBytes && (dense || r.ndim == 1)) {
    if (buf.size() < static_cast<size_t>(len)) buf.resize(static_cast<size_t>(len));
    note_peak(peak, static_cast<uint64_t>(len));
    f->read_data(static_cast<uint64_t>(at + lo * si), static_cast<uint64_t>(len), buf.data());
    copy_region(sd, dd, buf.data() - lo * si, dst, r);
    return;
  }
  const int64_t stride = r.ss[0] < 0 ? -r.ss[0] : (r.ss[0] > 0 ? r.ss[0] : 1);
  const int64_t room = kBounceBytes / si - (inner_hi - inner_lo + 1);  // elements left for the outer dim
  const int64_t per = room > 0 ? room / stride + 1 : 1;  // outer indices whose span fits
  if (r.ndim == 1 || (dense && per > 1)) {
    for (int64_t b = 0; b < r.shape[0]; b += per) {
      Region c = r;
      c.shape[0] = std::min(per, r.shape[0] - b);
      pread_region(f, sd, dd, at + b * r.ss[0] * si, dst + b * r.ds[0] * di, c, buf, peak);
    }
    return;
  }
  Region sub{};
  sub.ndim = r.ndim - 1;
  for (int k = 1; k < r.ndim; ++k) {
    sub.shape[k - 1] = r.shape[k];
    sub.ss[k - 1] = r.ss[k];
    sub.ds[k - 1] = r.ds[k];
  }
  for (int64_t b = 0; b < r.shape[0]; ++b)
    pread_region(f, sd, dd, at + b * r.ss[0] * si, dst + b * r.ds[0] * di, sub, buf, peak);
}

}  // namespace

namespace {

// Whether the kernel has MADV_POPULATE_WRITE (Linux >= 5.14), asked once on a page of our own:
// an EINVAL on a caller's range later means that range (say, an I/O mapping), not the kernel.
bool kernel_can_populate() {
  static const bool can = [] {
    long page = sysconf(_SC_PAGESIZE);
    void* p = mmap(nullptr, static_cast<size_t>(page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    bool ok = madvise(p, static_cast<size_t>(page), MADV_POPULATE_WRITE) == 0;
    munmap(p, static_cast<size_t>(page));
    return ok;
  }();
  return can;
}

}  // namespace

bool populate_pages(char* dst, size_t nbytes) {
  if (!kernel_can_populate()) return false;
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  // Whole pages only: a page shared with a neighbour is left to fault as it is written.
  uintptr_t a = (reinterpret_cast<uintptr_t>(dst) + page - 1) / page * page;
  uintptr_t b = (reinterpret_cast<uintptr_t>(dst) + nbytes) / page * page;
  if (b <= a) return true;
  // A range it cannot populate (an I/O mapping, no write permission) is the copy's to meet:
  // its writes fault those pages as they would have.
  return madvise(reinterpret_cast<void*>(a), b - a, MADV_POPULATE_WRITE) == 0;
}

void populate_dense(char* dst, int64_t span_bytes, int64_t written_bytes) {
  if (span_bytes < kPopulateMinBytes || span_bytes > 2 * written_bytes) return;
  populate_pages(dst, static_cast<size_t>(span_bytes));
}

size_t default_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<size_t>(n);
  }
  unsigned n = std::thread::hardware_concurrency();
  return n ? n : 1;
}

CopyEngine::CopyEngine(size_t threads) : pool_(threads ? threads : default_threads()) {}

uint64_t CopyEngine::execute(const std::vector<const MappedFile*>& files, const CopyOp* in_ops, size_t n) {
  std::vector<CopyOp> byte_ops;  // only when some op is sub-byte
  const CopyOp* ops = in_ops;
  for (size_t i = 0; i < n; ++i) {
    const CopyOp& op = in_ops[i];
    bool sub = op.src_dtype >= 0 && op.src_dtype < static_cast<int64_t>(DType::COUNT) &&
               dtype_sub_byte(static_cast<DType>(op.src_dtype));
    if (sub && op.src_dtype == op.dst_dtype) {
      if (byte_ops.empty()) byte_ops.assign(in_ops, in_ops + n);
      byte_ops[i] = as_bytes(op, i);
    }
  }
  if (!byte_ops.empty()) ops = byte_ops.data();
  for (size_t i = 0; i < n; ++i) validate(ops[i], i, files.size(), files);
  for (const MappedFile* f : files) {
    if (f->mapped()) {
      install_bus_handler();
      break;
    }
  }
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const CopyOp& op = ops[i];
    if (numel(op) == 0) continue;
    Region r = coalesce(op);
    int64_t di = static_cast<int64_t>(dtype_itemsize(static_cast<DType>(op.dst_dtype)));
    int64_t row = di;  // destination bytes per index of the outer dim
    for (int k = 1; k < r.ndim; ++k) row *= r.shape[k];
    total += static_cast<uint64_t>(numel(op)) * dtype_itemsize(static_cast<DType>(op.src_dtype));
    int64_t step = piece_rows(row);
    for (int64_t b = 0; b < r.shape[0]; b += step) {
      Piece p{i, r, op.src_offset + b * r.ss[0], op.dst_offset + b * r.ds[0]};
      p.region.shape[0] = std::min(step, r.shape[0] - b);
      pieces.push_back(p);
    }
  }
  const bool populate = populate_.load(std::memory_order_relaxed);
  pool_.run(pieces.size(), [&](size_t k) {
    const Piece& p = pieces[k];
    const CopyOp& op = ops[p.op];
    DType sd = static_cast<DType>(op.src_dtype), dd = static_cast<DType>(op.dst_dtype);
    int64_t si = static_cast<int64_t>(dtype_itemsize(sd)), di = static_cast<int64_t>(dtype_itemsize(dd));
    char* dst = reinterpret_cast<char*>(op.dst) + p.dst_offset * di;
    if (populate) populate_piece(dst, p.region, di);
    if (op.file < 0) {
      copy_region(sd, dd, reinterpret_cast<const char*>(op.src) + p.src_offset * si, dst, p.region);
      return;
    }
    const MappedFile* f = files[static_cast<size_t>(op.file)];
    if (f->mapped()) {
      guarded_copy(sd, dd, f->data() + op.src + p.src_offset * si, dst, p.region, f);
      return;
    }
    if (sd == dd && p.region.ndim == 1 && p.region.ss[0] == 1 && p.region.ds[0] == 1) {
      // Contiguous and no cast: read straight into the destination.
      f->read_data(static_cast<uint64_t>(op.src + p.src_offset * si), static_cast<uint64_t>(p.region.shape[0] * si), dst);
      return;
    }
    // pread: through this thread's bounce buffer, at most kBounceBytes (see pread_region).
    thread_local std::vector<char> buf;
    pread_region(f, sd, dd, op.src + p.src_offset * si, dst, p.region, buf, peak_bounce_);
  });
  return total;
}

void CopyEngine::parallel_memcpy(char* dst, const char* src, size_t n) {
  size_t parts = pool_.size();
  size_t chunk = (n + parts - 1) / parts;
  pool_.run(parts, [&](size_t i) {
    size_t b = i * chunk;
    if (b < n) std::memcpy(dst + b, src + b, std::min(chunk, n - b));
  });
}

}  // namespace streamload
