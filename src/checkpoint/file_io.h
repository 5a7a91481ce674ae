#pragma once
// POSIX file access for checkpoints: positioned reads (never whole files, never mmap), complete
// writes, fsync of files and directories, crc32 (zlib), and the process's I/O counters. Every
// error is a c10::Error that starts with the caller's function name and names the path.

#include <cstdint>
#include <string>
#include <utility>

namespace hyper_parallel::checkpoint::detail {

class File {
 public:
  /// Creates (or truncates) `path` for writing.
  static File create(const char* fn, const std::string& path);
  /// Opens `path` for reading.
  static File open(const char* fn, const std::string& path);

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  const std::string& path() const { return path_; }
  int64_t size() const;
  /// Writes all `n` bytes (retrying short writes).
  void write_all(const void* data, int64_t n);
  /// Reads exactly `n` bytes at `offset`; a file that ends first is reported as truncated.
  void pread_exact(void* dst, int64_t n, int64_t offset) const;
  void sync();
  /// Closes, reporting a failed close (the last chance to see a write error on some filesystems).
  void close();

 private:
  File(const char* fn, std::string path, int fd) : fn_(fn), path_(std::move(path)), fd_(fd) {}
  const char* fn_;
  std::string path_;
  int fd_ = -1;
};

/// fsyncs a directory, making the names created or renamed in it durable.
void sync_directory(const char* fn, const std::string& dir);

/// The whole content of a small text file (index.json, latest).
std::string read_text(const char* fn, const std::string& path);

/// Writes `text` to `path` (fsynced when `durable`). With `atomic`, writes `path`.tmp and renames
/// it over `path`, so readers see the old or the new content, never a part.
void write_text(const char* fn, const std::string& path, const std::string& text, bool durable, bool atomic);

uint32_t crc32_update(uint32_t crc, const void* data, int64_t n);

/// The I/O counters behind checkpoint::io_stats().
void count_read(int64_t bytes);
void count_written(int64_t bytes);

}  // namespace hyper_parallel::checkpoint::detail
