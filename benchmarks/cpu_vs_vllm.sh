#!/usr/bin/env bash
# tandem and vLLM's CPU build side by side on this CPU, through vLLM's own benchmark client
# (issue 23, item 6): the same model folder, fp32, one server at a time, alternating rounds.
#
#     VLLM_PYTHON=/tmp/vllm-venv/bin/python SHAREGPT=/tmp/sharegpt.json \
#         benchmarks/cpu_vs_vllm.sh OUTDIR [ROUNDS]
#
# SHAREGPT: a ShareGPT_V3 JSON file vLLM's client can read (the packaged one is cut off; write
# a whole one with `python -c "import json; from benchmarks.workloads import sharegpt_records;
# json.dump(list(sharegpt_records()), open('F', 'w'))"`). NUM_PROMPTS (120), RATE (inf) and
# MODEL_DIR (SmolLM2-135M-Instruct from tandem's model hub), SYSTEMS ("tandem vllm", or one of
# them) and VLLM_MEMORY_FRACTION (vLLM's --gpu-memory-utilization: on CPU the share of the
# node's memory it reserves, 0.3 here; its 0.92 default fails beside other processes) can be
# set. Each run's JSON
# (vLLM's --save-result) goes to OUTDIR/<system>-<round>.json; a table is printed at the end, and
# a plot of each round's req/s (OUTDIR/cpu_vs_vllm.png, with matplotlib). ROUNDS 0 only
# summarizes the JSON files already in OUTDIR.
set -uo pipefail
out="$1"
rounds="${2:-1}"
root="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out"
model="${MODEL_DIR:-$(cd "$root" && python -c 'from engine.model_hub import resolve_model; print(resolve_model("smollm2"))')}"
vpy="${VLLM_PYTHON:?set VLLM_PYTHON to a vLLM virtualenv python}"
n="${NUM_PROMPTS:-120}"
rate="${RATE:-inf}"

bench() {  # system port
    "$vpy" "$root/benchmarks/vllm_bench_client.py" --backend openai \
        --base-url "http://127.0.0.1:$2" --model smollm2 --tokenizer "$model" \
        --dataset-name sharegpt --dataset-path "$SHAREGPT" --num-prompts "$n" \
        --request-rate "$rate" --ignore-eos --seed 0 --save-result --result-dir "$out" \
        --result-filename "$1-$r.json" --percentile-metrics ttft,tpot,itl,e2el \
        --metric-percentiles 50,90,99 >"$out/$1-$r.log" 2>&1
    grep -E "Request throughput|Output token throughput|Median TTFT|Median TPOT" "$out/$1-$r.log"
}

wait_up() {  # port
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
        sleep 1
    done
    return 1
}

for r in $(seq "$rounds"); do
    systems="${SYSTEMS:-tandem vllm}"
    if [[ " $systems " == *" tandem "* ]]; then
        echo "== round $r: tandem $(date +%T)"
        (cd "$root" && tandem serve --model "$model" --served-model-name smollm2 --port 8000 \
            --detach >"$out/tandem-serve-$r.log" 2>&1)
        wait_up 8000 && bench tandem 8000
        (cd "$root" && tandem stop >/dev/null 2>&1)
    fi
    [[ " $systems " == *" vllm "* ]] || continue
    echo "== round $r: vLLM $(date +%T)"
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/vllm-cache}" \
        "$vpy" -m vllm.entrypoints.openai.api_server --model "$model" --dtype float32 \
        --gpu-memory-utilization "${VLLM_MEMORY_FRACTION:-0.3}" \
        --port 8001 --served-model-name smollm2 >"$out/vllm-serve-$r.log" 2>&1 &
    vpid=$!
    wait_up 8001 && bench vllm 8001
    kill "$vpid" && wait "$vpid" 2>/dev/null
done
python - "$out" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*-*.json")):
    d = json.loads(f.read_text())
    rows.append((f.stem, d["request_throughput"], d["output_throughput"], d["median_ttft_ms"],
                 d["median_tpot_ms"], d["median_itl_ms"]))
print("| run | req/s | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms |")
print("|---|---|---|---|---|---|")
for r in rows:
    print("| %s | %.3f | %.1f | %.0f | %.1f | %.1f |" % r)
by = {}  # system -> {round: req/s}
for name, rps, *_ in rows:
    system, _, rnd = name.rpartition("-")
    by.setdefault(system, {})[int(rnd)] = rps
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(0)
fig, ax = plt.subplots(figsize=(7, 3.5))
for i, (system, runs) in enumerate(sorted(by.items())):
    rounds = sorted(runs)
    ax.bar([r + 0.4 * i - 0.2 for r in rounds], [runs[r] for r in rounds], 0.4, label=system)
ax.set_xlabel("round (one server at a time, alternating)")
ax.set_ylabel("req/s")
ax.set_title("120 ShareGPT requests at once, vLLM's client, this CPU")
ax.legend(loc="lower center", ncol=2)
fig.tight_layout()
fig.savefig(pathlib.Path(sys.argv[1]) / "cpu_vs_vllm.png", dpi=110)
print("plot:", pathlib.Path(sys.argv[1]) / "cpu_vs_vllm.png")
PY
