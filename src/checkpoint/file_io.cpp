#include "file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <c10/util/Exception.h>

#include <hyper_parallel/checkpoint/checkpoint.h>

namespace hyper_parallel::checkpoint {

namespace {
std::atomic<int64_t> g_bytes_read{0}, g_bytes_written{0};
}  // namespace

IoStats io_stats() { return {g_bytes_read.load(), g_bytes_written.load()}; }

void reset_io_stats() {
  g_bytes_read = 0;
  g_bytes_written = 0;
}

namespace detail {

void count_read(int64_t bytes) { g_bytes_read += bytes; }
void count_written(int64_t bytes) { g_bytes_written += bytes; }

File File::create(const char* fn, const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, fn, ": cannot create ", path, ": ", std::strerror(errno));
  return File(fn, path, fd);
}

File File::open(const char* fn, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, fn, ": cannot open ", path, ": ", std::strerror(errno));
  return File(fn, path, fd);
}

File::File(File&& other) noexcept : fn_(other.fn_), path_(std::move(other.path_)), fd_(other.fd_) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fn_ = other.fn_;
    path_ = std::move(other.path_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

int64_t File::size() const {
  struct stat st {};
  TORCH_CHECK(::fstat(fd_, &st) == 0, fn_, ": cannot stat ", path_, ": ", std::strerror(errno));
  return static_cast<int64_t>(st.st_size);
}

void File::write_all(const void* data, int64_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    // Bounded requests: Linux writes at most ~2 GiB per call anyway.
    const ssize_t w = ::write(fd_, p, static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 30)));
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, fn_, ": cannot write ", path_, ": ", std::strerror(errno));
    p += w;
    n -= w;
  }
}

void File::pread_exact(void* dst, int64_t n, int64_t offset) const {
  auto* p = static_cast<char*>(dst);
  const int64_t begin = offset;
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 30)), offset);
    if (r < 0 && errno == EINTR) continue;
    TORCH_CHECK(r >= 0, fn_, ": cannot read ", path_, ": ", std::strerror(errno));
    TORCH_CHECK(r > 0, fn_, ": ", path_, " is truncated: expected bytes [", begin, ", ", offset + n,
                "), the file ends at ", offset);
    p += r;
    n -= r;
    offset += r;
  }
}

void File::sync() {
  TORCH_CHECK(::fsync(fd_) == 0, fn_, ": cannot fsync ", path_, ": ", std::strerror(errno));
}

void File::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  TORCH_CHECK(::close(fd) == 0, fn_, ": cannot close ", path_, ": ", std::strerror(errno));
}

void sync_directory(const char* fn, const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, fn, ": cannot open directory ", dir, ": ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, fn, ": cannot fsync directory ", dir, ": ", std::strerror(err));
}

std::string read_text(const char* fn, const std::string& path) {
  auto file = File::open(fn, path);
  const int64_t size = file.size();
  TORCH_CHECK(size <= (int64_t{1} << 30), fn, ": expected a small text file, got ", path, " of ", size,
              " bytes");
  std::string text(static_cast<size_t>(size), '\0');
  file.pread_exact(text.data(), size, 0);
  return text;
}

void write_text(const char* fn, const std::string& path, const std::string& text, bool durable, bool atomic) {
  const std::string target = atomic ? path + ".tmp" : path;
  {
    auto file = File::create(fn, target);
    file.write_all(text.data(), static_cast<int64_t>(text.size()));
    if (durable) file.sync();
    file.close();
  }
  if (!atomic) return;
  TORCH_CHECK(::rename(target.c_str(), path.c_str()) == 0, fn, ": cannot rename ", target, " to ", path, ": ",
              std::strerror(errno));
  if (durable) {
    const auto parent = std::filesystem::path(path).parent_path();
    sync_directory(fn, parent.empty() ? "." : parent.string());
  }
}

uint32_t crc32_update(uint32_t crc, const void* data, int64_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  uLong c = crc;
  while (n > 0) {  // zlib takes 32-bit lengths
    const auto len = static_cast<uInt>(std::min<int64_t>(n, int64_t{1} << 30));
    c = ::crc32(c, p, len);
    p += len;
    n -= len;
  }
  return static_cast<uint32_t>(c);
}

}  // namespace detail
}  // namespace hyper_parallel::checkpoint
