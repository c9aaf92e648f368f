"""Text in and out: tokenizers (SentencePiece, tiktoken, tokenizer.json), chat prompt formats, and
turning generated tokens into text piece by piece (streaming)."""
