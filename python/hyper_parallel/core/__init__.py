"""The layers of hyper_parallel: comm, dtensor, tensor_parallel (as in the C++ library)."""
