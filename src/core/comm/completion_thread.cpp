#include "completion_thread.h"

namespace hyper_parallel::comm::detail {

WorkerThread& completion_thread() {
  static WorkerThread* thread = new WorkerThread();  // its thread may outlive static destruction
  return *thread;
}

}  // namespace hyper_parallel::comm::detail
