"""llama_tp: tensor-parallel Llama inference on Meta-layout checkpoints."""

from .text.chat_format import Dialog, Message
from .generation import ChatPrediction, CompletionPrediction, Llama
from .text.tokenizer import Tokenizer

__all__ = ["ChatPrediction", "CompletionPrediction", "Dialog", "Llama", "Message", "Tokenizer"]
