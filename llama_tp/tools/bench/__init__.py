"""The benchmarks: a model's load, prefill and decode speed against its peers (speed.py, peers.py,
hf.py, llamacpp.py, gpt_fast.py; `python -m llama_tp.bench`), at several world sizes
(world_sizes.py), with speculation (speculative.py); serving against llama.cpp's server (serve.py,
servers.py, workload.py, stream_client.py, reuse.py, offline.py, profile.py; `python -m
llama_tp.bench_serve`); a layer's products on a GPU (products.py) and the random checkpoints they
read (random_checkpoint.py); and whether quantization changes answers (answer_agreement.py)."""
