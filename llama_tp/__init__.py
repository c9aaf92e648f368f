"""llama_tp: tensor-parallel Llama inference on Meta-layout checkpoints."""

__version__ = "0.1.0"  # pyproject.toml reads it from here

from .text.chat_format import Dialog, Message
from .generation import ChatPrediction, CompletionPrediction, Llama
from .text.tokenizer import Tokenizer

__all__ = ["ChatPrediction", "CompletionPrediction", "Dialog", "Llama", "Message", "Tokenizer"]
