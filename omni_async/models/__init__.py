"""Decoder models (Llama, Qwen2, Qwen3) in plain torch, and checkpoint loading."""

from .config import ModelConfig
from .decoder import DecoderModel
from .loader import load_model

__all__ = ["ModelConfig", "DecoderModel", "load_model"]
