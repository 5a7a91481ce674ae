"""Debugging aids for DTensor code: CommDebugMode, torch's and the original's."""

from hyper_parallel.core.dtensor.debug._comm_debug_mode import CommDebugMode

__all__ = ["CommDebugMode"]
