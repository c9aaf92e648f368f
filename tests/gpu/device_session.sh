#!/usr/bin/env bash
# A GPU session's one prepared script (docs/gpu.md): the GPU tests, then batch-1 decoding beside
# gpt-fast and the serving benchmark, on random weights of published shapes. From the repository
# root of a machine with a CUDA GPU:
#
#     bash tests/gpu/device_session.sh [part ...]     # parts: tests steps bench speculate serve (default: tests bench serve)
#
# steps: the GPU tests of whole decoding steps alone. speculate: batch-1 decoding with an int8 draft
# of the target, its verifying step compiled, against plain decoding (tools/bench/speculative.py). serve: the clients and requests of each load
# come from SERVE_LOADS ("clients:requests ...", default "1:16 16:64 64:192"), its rows from SERVE_ROWS (64),
# its max_seq_len from SERVE_SEQ_LEN (1024) and its KV cache from SERVE_KV_GIB (GiB; default: rows x max_seq_len);
# serve@MAX_SEQ_LEN@LOADS (LOADS with commas for spaces) serves with those instead, so that one call can
# compare servers. SERVE_PROFILE="clients:requests": after the first server's loads, one more load
# with py-spy recording the server's threads (py-spy's wheel in .whl/).
#
# It needs beside the checkout what such a machine may lack, in folders git ignores: .whl/ (wheels
# of the Python packages its image does not have) and .peers/ (gpt-fast, ../shared/peers/gpt-fast,
# and the Llama tokenizers, ../shared/data). Logs and JSON go to /tmp/gpu-session, and where $OUT
# is set (the folder a lent machine sends back) into one archive there, beside the summary; the
# last lines printed are the summary. SESSION_SECONDS: the call's own limit, from the script's start;
# each part's timeout then fits in what is left, a part with too little left is skipped, and the logs
# are archived after every part, so that a call cut short still sends back what it did.
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
left() {  # seconds left of SESSION_SECONDS, less a margin for the last archive
    echo $(( ${SESSION_SECONDS:-100000} - SECONDS - 15 ))
}
capped() {  # the timeout a part may take: what it wants, or what is left
    local wanted=$1 remaining
    remaining=$(left)
    echo $(( wanted < remaining ? wanted : remaining ))
}

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PATH"
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
    if [ "$(left)" -lt 30 ]; then
        note "$part: skipped, $(left) s left"
        continue
    fi
    case "$part" in
    tests)  # one test after another in the log (-v), the two-rank lost-rank jobs last
        timeout "$(capped 360)" python3 -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_sampler.py \
            tests/gpu/test_gpu_model.py tests/gpu/test_gpu_quantized.py tests/gpu/test_gpu_serving.py \
            tests/gpu/test_gpu_groups.py tests/gpu/test_gpu_lost_rank.py > "$LOGS/tests.log" 2>&1
        note "tests/gpu: rc $? in $((SECONDS - start)) s: $(tail -1 "$LOGS/tests.log")"
        note "tests/gpu: $(grep -c ' PASSED' "$LOGS/tests.log") passed; $(grep -E ' (FAILED|ERROR)' "$LOGS/tests.log" | head -8 | tr '\n' ' ')"
        ;;
    steps)
        timeout "$(capped 150)" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_model.py -k "whole_steps or compiled_steps" \
            > "$LOGS/steps.log" 2>&1
        note "whole steps on the GPU: rc $? in $((SECONDS - start)) s: $(tail -1 "$LOGS/steps.log")"
        if [ -n "${OUT:-}" ]; then grep -E "^(FAILED|E  )" "$LOGS/steps.log" | head -40 > "$OUT/steps-failures.txt"; fi
        ;;
    bench)
        checkpoint llama2-7b
        # ours, then gpt-fast in a process of its own on the same GPU (sampled as it samples), and the ratio
        timeout "$(capped 400)" python3 -m llama_tp.bench --ckpt_dir /dev/shm/llama2-7b --dtype bf16 --compile true \
            --compare gpt-fast --gpt_fast_dir .peers/gpt-fast \
            --load_repeats 0 --repeats 3 --new_tokens 128 --batch_sizes 1,8 --prefill_lengths 128 \
            --json_path "$LOGS/bench-7b.json" > "$LOGS/bench-7b.log" 2>&1
        note "bench 7B beside gpt-fast: rc $?: $(grep -E 'decode_batch|roofline|gpt-fast|share' "$LOGS/bench-7b.log" | tr '\n' ' ')"
        note "bench part: $((SECONDS - start)) s"
        ;;
    speculate)
        checkpoint llama2-7b
        timeout "$(capped 300)" python3 -m llama_tp.tools.bench.speculative --ckpt_dir /dev/shm/llama2-7b \
            --tokenizer_path ../shared/data/llama2-tokenizer.model --dtype bf16 --compile true \
            --speculate draft --draft_quantize int8 --speculate_k 4 --repeats 2 --new_tokens 128 \
            --json_path "$LOGS/speculate-7b.json" > "$LOGS/speculate-7b.log" 2>&1
        note "speculation 7B, int8 draft, k 4: rc $?: $(grep -E -A3 '^ *way' "$LOGS/speculate-7b.log" | tr '\n' ' ')"
        note "speculate part: $((SECONDS - start)) s"
        ;;
    serve*)  # serve, or serve@MAX_SEQ_LEN@LOADS (LOADS as SERVE_LOADS, with commas for spaces)
        IFS=@ read -r _ seq_len loads <<< "$part"
        seq_len="${seq_len:-${SERVE_SEQ_LEN:-1024}}"
        loads="${loads:-${SERVE_LOADS:-1:16 16:64 64:192}}"
        checkpoint llama2-7b
        # The 7B shape is Llama 2's, trained for 4096 positions: a longer max_seq_len is this benchmark's choice.
        LLAMA_TP_ALLOW_LONG_CONTEXT=1 torchrun --nproc_per_node 1 launch/serve.py --ckpt_dir /dev/shm/llama2-7b \
            --tokenizer_path ../shared/data/llama2-tokenizer.model --max_batch_size "${SERVE_ROWS:-64}" --max_seq_len "$seq_len" \
            ${SERVE_KV_GIB:+--kv_cache_memory "$SERVE_KV_GIB"} > "$LOGS/server-$seq_len.log" 2>&1 &
        server=$!
        for _ in $(seq "$(capped 180)"); do  # until it answers, or its process ends
            curl -sf http://127.0.0.1:8000/health > /dev/null && break
            kill -0 "$server" 2>/dev/null || break
            sleep 1
        done
        note "server (max_seq_len $seq_len) ready after $((SECONDS - start)) s: $(grep -o -E 'compiled the decoding step in [0-9.]* seconds|[0-9]+ tokens of KV cache: about [0-9.]+ conversations' "$LOGS/server-$seq_len.log" | tr '\n' ' ')"
        if curl -sf http://127.0.0.1:8000/health > /dev/null; then
            for load in ${loads//,/ }; do
                set -- ${load/:/ }
                timeout "$(capped 120)" python3 -m llama_tp.bench_serve --concurrency "$1" --requests "$2" --max_tokens 128 \
                    --sampling sampled --json_path "$LOGS/serve-$seq_len-$1.json" > "$LOGS/serve-$seq_len-$1.log" 2>&1
                note "serve $1 clients, max_seq_len $seq_len: rc $?: $(grep -A1 -E '^ *concurrency' "$LOGS/serve-$seq_len-$1.log" | tail -1)"
            done
            if [ -n "${SERVE_PROFILE:-}" ] && command -v py-spy > /dev/null; then  # where the server's host time goes
                set -- ${SERVE_PROFILE/:/ }
                py-spy record --nonblocking --threads --idle --format raw -r 200 -d 5 -o "$LOGS/pyspy-$seq_len-$1.txt" \
                    --pid "$(pgrep -P "$server" | head -1)" > "$LOGS/pyspy.log" 2>&1 &
                profiler=$!
                timeout "$(capped 60)" python3 -m llama_tp.bench_serve --concurrency "$1" --requests "$2" --max_tokens 128 \
                    --sampling sampled > "$LOGS/serve-profiled.log" 2>&1
                wait "$profiler"
                note "py-spy of $1 clients: $(wc -l < "$LOGS/pyspy-$seq_len-$1.txt" 2>/dev/null) stacks; $(tail -1 "$LOGS/pyspy.log")"
                unset SERVE_PROFILE
            fi
        else
            note "server failed: $(tail -5 "$LOGS/server-$seq_len.log" | tr '\n' ' ' | cut -c1-1500)"
        fi
        kill "$server"; wait "$server" 2>/dev/null
        note "serve part: $((SECONDS - start)) s"
        ;;
    esac
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/logs.tgz" -C "$LOGS" . && cp "$summary" "$OUT/"
    fi
done
echo "=== summary"
cat "$summary"
