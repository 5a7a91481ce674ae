"""The layers of hyper_parallel: comm, dtensor, tensor_parallel, data_parallel (as in the C++ library)."""
