// hyper_parallel._C: see bindings.h.
#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "hyper_parallel's C++ core (comm, dtensor, tensor_parallel, MC2, data_parallel, fully_shard, "
      "checkpoint)";
  hp_python::bind_comm(m);
  hp_python::bind_dtensor(m);
  hp_python::bind_tensor_parallel(m);
  hp_python::bind_mc2(m);
  hp_python::bind_data_parallel(m);
  hp_python::bind_fully_shard(m);
  hp_python::bind_checkpoint(m);
}
