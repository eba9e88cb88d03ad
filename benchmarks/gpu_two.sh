#!/usr/bin/env bash
# The 2-GPU measurements (issue 28) in named sections, for a lent machine with 2 GPUs:
#
#     benchmarks/gpu_two.sh OUTDIR SECTION...
#
# Sections: tests (every 2-GPU test under tests/gpu/ and the KV receiver's stream test),
# disagg (the layer-wise KV stream against NCCL point to point, benchmarks/gpu_disagg.py;
# disagg-early: the same with TANDEM_KV_POST=early),
# overlap (a send behind prefill kernels, benchmarks/gpu_overlap.py), migration
# (benchmarks/gpu_migration.py), chaos (kill decode, kill prefill, hang decode under load, with
# the resume breakdown; chaos-trace: kill-decode with TANDEM_TRACE=1, each resumed attempt's
# milestones laid out by benchmarks/trace_layout.py), kill-stall (a SIGKILLed CUDA process with an
# NCCL pair into GPU 0, and the CUDA calls of GPU 0's other processes, benchmarks/gpu_kill_stall.py),
# goodput-two / goodput-pd
# (benchmarks/gpu_serve.py, a topology's capacity and its SLO attainment at 0.6x..1.3x of it,
# vLLM-sampled ShareGPT and 2k-8k prompts; goodput-sharegpt / goodput-long: one workload, 2
# colocated on GPUs 0,1 beside 1P1D on 2,3 of a 4-GPU machine, RATE_SECONDS per rate), served
# (issue 23: one worker through the gateway against the offline engine; SERVED_PHASES: other
# gpu_serve.py phases, SERVE_CLIENT=httpx: the client of the runs before 2026-11-28,
# SERVED_PROFILE=1: CPU per process and py-spy stacks where py-spy is on PATH; SERVED_TEXT=1:
# the prompts sent as text, as vLLM's client sends ShareGPT (the offline phase takes the ids);
# SERVED_CHAT=1: as text, each the one user message of a chat, to /v1/chat/completions;
# served-gateways: the same and through two gateway processes sharing the port, with CPU per
# process; 1 GPU), steps and fp8 (issue 23's step table against both floors, issue 26's ITL and
# throughput with repeats; 1 GPU), fp8-steps (bf16 and fp8 + fp8 KV on vLLM's sample, steps by
# kind: device time and waits for the host; 1 GPU), fp8-pad (issue 26: the FP8 GPU tests, then
# fp8 + fp8 KV with _scaled_mm's rows padded to multiples of 128 and without, then bf16; 1 GPU),
# tests-tp, tp-scaling, pd70 and pd70-side (issue 29: tensor parallelism on 2-8 GPUs; pd70-side
# runs both 70B topologies at once on 4T GPUs), local-prefill (issue 25: a conversation's next
# turn by write-back or prefilled on its decode worker, 1P1D multi-turn).
# Every section's log and JSON go under OUTDIR/SECTION; each runs under its own time limit
# (GPU_TWO_LIMIT_<SECTION>, seconds) so one overrun leaves the others their turn. Two runs can
# share a 4-GPU machine, each on its own CUDA_VISIBLE_DEVICES pair, with GPU_TWO_SHARED=1 (no
# `ray stop` between sections: it would stop the other's clusters too).
#
# The model folder is the Llama-3-8B shape (benchmarks/configs/llama3-8b, dummy bf16 weights)
# with the Llama-3 tokenizer beside it: TOKENIZER_DIR (default .gpu_carry) holds tokenizer.json
# (or tokenizer.json.xz) and tokenizer_config.json (benchmarks/fetch_llama3_tokenizer.sh).
set -uo pipefail
out="$1"
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
model="${MODEL_DIR:-/tmp/llama3-8b}"
tok="${TOKENIZER_DIR:-$root/.gpu_carry}"
mkdir -p "$model" "$out"
cp benchmarks/configs/llama3-8b/config.json "$model/"
if [ -f "$tok/tokenizer.json.xz" ]; then
    xz -dc "$tok/tokenizer.json.xz" >"$model/tokenizer.json"
elif [ -f "$tok/tokenizer.json" ]; then
    cp "$tok/tokenizer.json" "$model/"
fi
[ -f "$tok/tokenizer_config.json" ] && cp "$tok/tokenizer_config.json" "$model/"
sample=benchmarks/data/vllm_sharegpt_llama3_1000.json
dummy=(--engine load_format=dummy --engine max_model_len=8192)
# the learned length predictor's artifact (router/data) may be left out of the carry
[ -n "${PREDICTOR:-}" ] && dummy+=(--predictor "$PREDICTOR")
fracs=(0.6 0.7 0.8 0.9 1.0 1.1 1.2 1.3)

section() {
    local name="$1" limit="$2"
    shift 2
    local var="GPU_TWO_LIMIT_${name//-/_}"
    limit="${!var:-$limit}"
    mkdir -p "$out/$name"
    echo "== $name (limit ${limit} s) $(date +%T)"
    timeout --signal=INT --kill-after=20 "$limit" "$@" >"$out/$name/log.txt" 2>&1
    local rc=$?
    echo "== $name rc=$rc $(date +%T)"
    grep -v "Assertion\|IndexKernel" "$out/$name/log.txt" | tail -n "${TAIL:-25}"
    if [ -z "${GPU_TWO_SHARED:-}" ]; then  # set when another run shares the machine
        ray stop --force >/dev/null 2>&1
        pkill -f "cluster.cli serve" >/dev/null 2>&1
    fi
    return 0
}

for s in "$@"; do
    case "$s" in
    tests)
        section tests 300 python -m pytest -q -p no:cacheprovider \
            tests/gpu/test_kv_receiver_streams.py tests/gpu/test_disagg_nccl.py \
            tests/gpu/test_migration_nccl.py tests/gpu/test_nccl_bounds.py ;;
    tests-pd)  # the one-device P/D and migration tests over NCCL (2 GPUs)
        section tests-pd 300 python -m pytest -q -p no:cacheprovider -o faulthandler_timeout=240 \
            tests/gpu/test_disagg_nccl.py tests/gpu/test_migration_nccl.py ;;
    tests-changed)  # the tests of what changed since a full tests run
        section tests-changed 150 python -m pytest -q -p no:cacheprovider \
            tests/gpu/test_kv_receiver_streams.py tests/gpu/test_migration_nccl.py ;;
    disagg)
        section disagg 240 python benchmarks/gpu_disagg.py --reps 3 --out "$out/disagg/gpu_disagg.json" ;;
    disagg-early)  # the same with each layer's send posted at once, waiting on the GPU
        section disagg-early 240 env TANDEM_KV_POST=early python benchmarks/gpu_disagg.py --reps 3 \
            --out "$out/disagg-early/gpu_disagg.json" ;;
    overlap)
        section overlap 120 python benchmarks/gpu_overlap.py --carveouts 0 \
            --loads gemm attention triton layer triton-layer --out "$out/overlap/gpu_overlap.json" ;;
    overlap-channels)  # fewer NCCL channels, cuBLAS leaving SMs: can a send run beside GEMMs?
        section overlap-channels 120 env NCCL_MAX_P2P_NCHANNELS=4 python benchmarks/gpu_overlap.py \
            --carveouts 0 16 --loads gemm layer --out "$out/overlap-channels/gpu_overlap.json" ;;
    kill-stall)  # does a SIGKILLed process with an NCCL pair into GPU 0 stall GPU 0's others?
        section kill-stall 240 python benchmarks/gpu_kill_stall.py --out "$out/kill-stall/gpu_kill_stall.json" ;;
    migration-32k)  # the copy's per-chunk breakdown at 32k only
        section migration-32k 150 python benchmarks/gpu_migration.py --contexts 32768 \
            --repeats 2 --moves 2 --window 1 --out "$out/migration-32k/gpu_migration.json" ;;
    migration)
        section migration 240 python benchmarks/gpu_migration.py --repeats 2 --moves 6 --window 4 \
            --out "$out/migration/gpu_migration.json" ;;
    chaos)
        section chaos 330 python benchmarks/chaos.py --device cuda --model "$model" \
            --num-prefill 2 --num-decode 2 --prefill-gpus 0.5 --decode-gpus 0.5 \
            --workload sharegpt-ids --scenarios kill-decode,kill-prefill,hang-decode \
            --requests 150 --concurrency 32 --max-tokens 256 --max-concurrent 64 --expect none \
            --kv-blocks 6000 --long-tokens 4096 --engine load_format=dummy \
            --engine max_model_len=8192 --json "$out/chaos/chaos_gpu.json" ;;
    chaos-trace)  # kill-decode alone with every milestone traced, laid out per resumed attempt
        section chaos-trace 200 env TANDEM_TRACE=1 python benchmarks/chaos.py --device cuda \
            --model "$model" --num-prefill 2 --num-decode 2 --prefill-gpus 0.5 --decode-gpus 0.5 \
            --workload sharegpt-ids --scenarios kill-decode --requests 150 --concurrency 32 \
            --max-tokens 256 --max-concurrent 64 --expect none --kv-blocks 6000 \
            --engine load_format=dummy --engine max_model_len=8192 \
            --json "$out/chaos-trace/chaos_gpu.json"
        python benchmarks/trace_layout.py "$out/chaos-trace/log.txt" >"$out/chaos-trace/layout.txt"
        grep -a "stall:" "$out/chaos-trace/log.txt" >"$out/chaos-trace/stalls.txt"  # StallWatch
        head -n 60 "$out/chaos-trace/layout.txt" ;;
    goodput-two | goodput-pd)
        section "$s" 590 python benchmarks/gpu_serve.py run --model "$model" \
            --phases "${s#goodput-}" --out "$out/$s" "${dummy[@]}" --requests-file "$sample" \
            --warmup 64 --num-prompts 1000 --rate-prompts 200 --long-prompts 200 \
            --long-rate-prompts 60 --rate-seconds 30 --fracs "${fracs[@]}" --bench-timeout 300 ;;
    goodput-sharegpt | goodput-long)  # 4 GPUs: 2 colocated on 0,1 beside 1P1D on 2,3
        w="${s#goodput-}"
        section "$s" 590 bash -c "
            run() { python benchmarks/gpu_serve.py run --model '$model' --phases \$1 --gpus \$2 \
                --workloads $w --out '$out/$s/'\$1 ${dummy[*]} --requests-file $sample \
                --warmup 64 --num-prompts 1000 --rate-prompts 200 --long-prompts 200 \
                --long-rate-prompts 60 --rate-seconds \${RATE_SECONDS:-25} --fracs ${fracs[*]} \
                --bench-timeout 300 >'$out/$s/'\$1.log 2>&1; }
            run two 0,1 & run pd 2,3 & wait
            tail -n 12 '$out/$s/two.log' '$out/$s/pd.log'" ;;
    served)
        section served 420 python benchmarks/gpu_serve.py run --model "$model" \
            --phases "${SERVED_PHASES:-offline,one}" --inf-only --requests-file "$sample" \
            "${dummy[@]}" --client "${SERVE_CLIENT:-raw}" ${SERVED_PROFILE:+--profile} \
            ${SERVED_TEXT:+--text-prompts} ${SERVED_CHAT:+--chat} \
            --out "$out/served" ;;
    steps)  # issue 23's step table: decode-1, decode-256, mixed, pipelined and serial, each
        # against its floor at the burst and the sustained bf16 rate (1 GPU)
        section steps 240 python benchmarks/gpu_launch.py --variants small --rounds 2 \
            --reps 30 --out "$out/steps/gpu_launch.json" ;;
    fp8)  # issue 26: ITL and ShareGPT throughput, bf16 / fp8 / fp8 + fp8 KV, FP8_REPEATS runs
        # each (the prefix cache reset before each; the median reported with the spread; 1 GPU)
        section fp8 540 python benchmarks/gpu_fp8_weights.py --kv8 --repeats "${FP8_REPEATS:-2}" \
            --out "$out/fp8/gpu_fp8_weights.json" ;;
    fp8-steps)  # issue 26: vLLM's ShareGPT sample, bf16 then fp8 weights + fp8 KV, each step
        # kind's device time and wait for the host (gpu_async.py); a pair in one call (1 GPU)
        section fp8-steps 400 bash -c "python benchmarks/gpu_async.py --workloads vllm_sharegpt \
            --settings on --out '$out/fp8-steps/bf16' && python benchmarks/gpu_async.py \
            --workloads vllm_sharegpt --settings on --quantization fp8 --kv-cache-dtype fp8 \
            --out '$out/fp8-steps/fp8_kv8'" ;;
    fp8-pad)  # issue 26: Fp8Linear's padded _scaled_mm rows checked, then A/B (1 GPU)
        section fp8-pad 560 bash -c "python -m pytest -q -p no:cacheprovider \
            tests/gpu/test_fp8_weights_gpu.py && python benchmarks/gpu_async.py \
            --workloads vllm_sharegpt --settings on --quantization fp8 --kv-cache-dtype fp8 \
            --out '$out/fp8-pad/padded' && python benchmarks/fp8_rows_ab.py \
            scaled_mm_pad_max_rows=0 benchmarks/gpu_async.py --workloads vllm_sharegpt \
            --settings on --quantization fp8 --kv-cache-dtype fp8 --out '$out/fp8-pad/unpadded' \
            && python benchmarks/gpu_async.py --workloads vllm_sharegpt --settings on \
            --out '$out/fp8-pad/bf16'" ;;
    served-gateways)  # the same, through one gateway and through two sharing the port
        section served-gateways 560 python benchmarks/gpu_serve.py run --model "$model" \
            --phases offline,one,one@gw2 --inf-only --requests-file "$sample" "${dummy[@]}" \
            --profile --out "$out/served-gateways" ;;
    tests-tp)  # issue 29: every tensor-parallel GPU test (2 GPUs; 3-4 for the P/D pairs);
        # TP_TESTS: a subset (pytest arguments, e.g. one file and a -k)
        read -r -a tp_tests <<<"${TP_TESTS:-tests/gpu/test_tensor_parallel_gpu.py \
tests/gpu/test_tensor_parallel_kv_gpu.py tests/gpu/test_tensor_parallel_disagg_gpu.py \
tests/gpu/test_tensor_parallel_migration_gpu.py}"
        section tests-tp 560 python -m pytest -q -p no:cacheprovider -o faulthandler_timeout=240 \
            -rs "${tp_tests[@]}" ;;
    tp-scaling)  # issue 29: the 8B shape at TP ${TP_SIZES:-1 2 4}, ITL against floor, throughput
        read -r -a sizes <<<"${TP_SIZES:-1 2 4}"
        section tp-scaling 590 python benchmarks/gpu_tp.py --tp "${sizes[@]}" \
            --out "$out/tp-scaling/gpu_tp.json" ;;
    pd70 | pd70-side)  # issue 29: Llama-3-70B's shape, 1P(TP T) + 1D(TP T) against 2 colocated at TP T, on
        # the same 2T GPUs (T = ${TP:-4}; QUANT=fp8 for 2 x TP 2 on four 80 GB cards, or TP=1
        # on two H200s), ShareGPT and Dynamo's 3k-in / 150-out. PD70_PHASES: one topology per
        # call where a call's time is short (or other splits at TP 1: PD70_PHASES=2p1d,3col
        # for Dynamo's 3k-in prompts, whose prefill needs more GPUs than their decode); FRACS:
        # fewer rates; LONG: the long burst's size.
        t="${TP:-4}"
        read -r -a fracs <<<"${FRACS:-${fracs[*]}}"
        big="${BIG_MODEL_DIR:-/tmp/llama3-70b}"
        mkdir -p "$big" && cp "$model"/tokenizer*.json "$big/" 2>/dev/null
        python -c "import json, sys; sys.path.insert(0, '.'); from benchmarks.gpu_fp8_weights \
import big_config; json.dump(big_config(80), open('$big/config.json', 'w'))"
        quant=(); [ -n "${QUANT:-}" ] && quant=(--engine "quantization=$QUANT")
        # REF_RATE / LONG_REF_RATE: offer the topologies the same rates (fracs of these)
        [ -n "${REF_RATE:-}" ] && quant+=(--ref-rate "$REF_RATE")
        [ -n "${LONG_REF_RATE:-}" ] && quant+=(--long-ref-rate "$LONG_REF_RATE")
        args70=(--model "$big" "${dummy[@]}" "${quant[@]}" --requests-file "$sample" \
            --workloads "${WORKLOADS:-sharegpt,long}" --warmup 32 --num-prompts 500 \
            --rate-prompts 120 --long-prompts "${LONG:-120}" --long-rate-prompts 40 \
            --long-input 3000 3000 --long-output 150 150 --rate-seconds "${RATE_SECONDS:-20}" \
            --fracs "${fracs[@]}" --extend "${EXTEND:-4}" --steady-from "${STEADY_FROM:-0}" \
            --bench-timeout 240)
        if [ "$s" = pd70 ]; then
            section pd70 590 python benchmarks/gpu_serve.py run \
                --phases "${PD70_PHASES:-pd-p${t}d${t},two-tp${t}}" --out "$out/pd70" "${args70[@]}"
        else  # pd70-side: 1P1D on GPUs 0..2T-1 beside 2 colocated on 2T..4T-1, the same rates
            # (REF_RATE / LONG_REF_RATE) offered to both at the same time (4T GPUs)
            lo=$(seq -s, 0 $((2 * t - 1))) hi=$(seq -s, $((2 * t)) $((4 * t - 1)))
            mkdir -p "$out/pd70-side"
            section pd70-side 590 bash -c '
                o="$1" lo="$2" hi="$3" t="$4"; shift 4
                python benchmarks/gpu_serve.py run --phases "pd-p${t}d${t}" --gpus "$lo" \
                    --out "$o/pd" "$@" >"$o/pd.log" 2>&1 &
                python benchmarks/gpu_serve.py run --phases "two-tp${t}" --gpus "$hi" \
                    --out "$o/two" "$@" >"$o/two.log" 2>&1 &
                wait; tail -n 15 "$o/pd.log" "$o/two.log"' _ "$out/pd70-side" "$lo" "$hi" "$t" \
                "${args70[@]}"
        fi ;;
    local-prefill)  # issue 25: a disaggregated conversation's next turn, write-back to a shared
        # disk tier against --local-prefill-tokens (1P1D on GPUs 0,1; LP_VARIANTS, LP_USERS)
        section local-prefill 590 python benchmarks/gpu_kv_tiers.py serve --model "$model" \
            --topology pd --variants "${LP_VARIANTS:-disk,local}" --users "${LP_USERS:-64}" \
            --think-s 4 --max-output 256 --conversations 256 --pool-blocks 8192 \
            --miss-conversations 0 --predictor none --out "$out/local-prefill" ;;
    *) echo "unknown section $s" ;;
    esac
done
