"""The original's import path of get_model_state_dict and set_model_state_dict."""

from hyper_parallel.core.fully_shard.model_state_dict import get_model_state_dict, set_model_state_dict

__all__ = ["get_model_state_dict", "set_model_state_dict"]
