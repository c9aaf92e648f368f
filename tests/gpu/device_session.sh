#!/usr/bin/env bash
# A GPU session's one prepared script (docs/gpu.md): the GPU tests, then batch-1 decoding beside
# gpt-fast and the serving benchmark, on random weights of published shapes. From the repository
# root of a machine with a CUDA GPU:
#
#     bash tests/gpu/device_session.sh [part ...]     # parts: tests steps bench serve (default: tests bench serve)
#
# steps: the GPU tests of whole decoding steps alone. serve: the clients and requests of each load
# come from SERVE_LOADS ("clients:requests ...", default "1:16 16:64 64:192"), its rows from SERVE_ROWS (64),
# its max_seq_len from SERVE_SEQ_LEN (1024) and its KV cache from SERVE_KV_GIB (GiB; default: rows x max_seq_len).
#
# It needs beside the checkout what such a machine may lack, in folders git ignores: .whl/ (wheels
# of the Python packages its image does not have) and .peers/ (gpt-fast, ../shared/peers/gpt-fast,
# and the Llama tokenizers, ../shared/data). Logs and JSON go to /tmp/gpu-session, and where $OUT
# is set (the folder a lent machine sends back) into one archive there, beside the summary; the
# last lines printed are the summary.
set -uo pipefail
LOGS=/tmp/gpu-session
mkdir -p "$LOGS"
parts="${*:-tests bench serve}"
summary="$LOGS/summary.txt"
: > "$summary"
note() {  # a line of the summary, sent back at once where a lent machine sends $OUT back
    echo "$*" | tee -a "$summary"
    if [ -n "${OUT:-}" ]; then cp "$summary" "$OUT/"; fi
}

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # torchrun's scripts import the checkout's llama_tp
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
mkdir -p ../shared/data && cp .peers/*-tokenizer.model ../shared/data/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$summary"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$summary"

checkpoint() {  # a random checkpoint of a published shape in /dev/shm, made once
    [ -f "/dev/shm/$1/params.json" ] || python3 -m llama_tp.tools.bench.random_checkpoint --shape "$1" --out "/dev/shm/$1" \
        > "$LOGS/checkpoint-$1.log" 2>&1
}

for part in $parts; do
    start=$SECONDS
    case "$part" in
    tests)
        timeout 360 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$LOGS/tests.log" 2>&1
        note "tests/gpu: rc $? in $((SECONDS - start)) s: $(tail -1 "$LOGS/tests.log")"
        ;;
    steps)
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_model.py -k "whole_steps or compiled_steps" \
            > "$LOGS/steps.log" 2>&1
        note "whole steps on the GPU: rc $? in $((SECONDS - start)) s: $(tail -1 "$LOGS/steps.log")"
        if [ -n "${OUT:-}" ]; then grep -E "^(FAILED|E  )" "$LOGS/steps.log" | head -40 > "$OUT/steps-failures.txt"; fi
        ;;
    bench)
        checkpoint llama2-7b
        # ours, then gpt-fast in a process of its own on the same GPU (sampled as it samples), and the ratio
        timeout 400 python3 -m llama_tp.bench --ckpt_dir /dev/shm/llama2-7b --dtype bf16 --compile true \
            --compare gpt-fast --gpt_fast_dir .peers/gpt-fast \
            --load_repeats 0 --repeats 3 --new_tokens 128 --batch_sizes 1,8 --prefill_lengths 128 \
            --json_path "$LOGS/bench-7b.json" > "$LOGS/bench-7b.log" 2>&1
        note "bench 7B beside gpt-fast: rc $?: $(grep -E 'decode_batch|roofline|gpt-fast|share' "$LOGS/bench-7b.log" | tr '\n' ' ')"
        note "bench part: $((SECONDS - start)) s"
        ;;
    serve)
        checkpoint llama2-7b
        torchrun --nproc_per_node 1 launch/serve.py --ckpt_dir /dev/shm/llama2-7b \
            --tokenizer_path ../shared/data/llama2-tokenizer.model --max_batch_size "${SERVE_ROWS:-64}" --max_seq_len "${SERVE_SEQ_LEN:-1024}" \
            ${SERVE_KV_GIB:+--kv_cache_memory "$SERVE_KV_GIB"} > "$LOGS/server.log" 2>&1 &
        server=$!
        for _ in $(seq 180); do  # until it answers, or its process ends
            curl -sf http://127.0.0.1:8000/health > /dev/null && break
            kill -0 "$server" 2>/dev/null || break
            sleep 1
        done
        note "server ready after $((SECONDS - start)) s: $(grep -o -E 'compiled the decoding step in [0-9.]* seconds|[0-9]+ tokens of KV cache[^.]*' "$LOGS/server.log" | tr '\n' ' ')"
        if ! curl -sf http://127.0.0.1:8000/health > /dev/null; then note "server failed: $(tail -5 "$LOGS/server.log" | tr '\n' ' ' | cut -c1-1500)"; fi
        for load in ${SERVE_LOADS:-1:16 16:64 64:192}; do
            set -- ${load/:/ }
            timeout 120 python3 -m llama_tp.bench_serve --concurrency "$1" --requests "$2" --max_tokens 128 \
                --sampling sampled --json_path "$LOGS/serve-$1.json" > "$LOGS/serve-$1.log" 2>&1
            note "serve $1 clients: rc $?: $(grep -A1 -E '^ *concurrency' "$LOGS/serve-$1.log" | tail -1)"
        done
        kill "$server"; wait "$server" 2>/dev/null
        note "serve part: $((SECONDS - start)) s"
        ;;
    esac
done
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/logs.tgz" -C "$LOGS" . && cp "$summary" "$OUT/"
fi
echo "=== summary"
cat "$summary"
