#include "completion_thread.h"

#include <map>
#include <mutex>

namespace hyper_parallel::comm::detail {

WorkerThread& completion_thread(const GroupImpl& group) {
  static std::mutex mutex;
  // Never freed: a thread may outlive static destruction. Keyed by the group's address; a group
  // made later at the same address shares the thread, which only orders their jobs.
  static auto* threads = new std::map<const GroupImpl*, WorkerThread*>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& thread = (*threads)[&group];
  if (thread == nullptr) thread = new WorkerThread();
  return *thread;
}

}  // namespace hyper_parallel::comm::detail
