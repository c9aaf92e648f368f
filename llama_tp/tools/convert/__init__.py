"""Importing Llama-family weights into Meta's layout: Hugging Face folders and GGUF files.

    python -m llama_tp.convert hf SRC_DIR DST_DIR --mp N [--dtype bf16|fp16|fp32] [--quantize int8|int4]
    python -m llama_tp.convert gguf FILE DST_DIR --mp N [--dtype ...] [--quantize int8|int4]
"""
