"""The model: the transformer and its passes (transformer.py), its attention (attention.py), rotary
embeddings (rotary.py) and norm (norm.py), its shape from params.json (args.py),
its KV cache in blocks (kv_cache.py) and the record of what each cache row holds (prefix_cache.py),
one-token attention through block masks (block_attention.py), the GPU's recorded steps
(step_graphs.py), the quantized layers (quantize.py) and the memory plan (memory.py)."""
