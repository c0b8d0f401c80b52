#!/usr/bin/env bash
# The learner's and kernels' GPU figures, as run on the H200 through the device tool (one call per group).
#
#   bash benchmarks/learner/run_gpu.sh learner-packed  # bench learner, hybrid: packed 16K-1M, single 1M
#   bash benchmarks/learner/run_gpu.sh head learner    # logprob head memory; 16K/64K steady state, single 1M
#   bash benchmarks/learner/run_gpu.sh tests-kernels   # H200 kernel/learner tests beside the table's compiles; table vs fla
#   bash benchmarks/learner/run_gpu.sh global          # the all-MLA layout
#   bash benchmarks/learner/run_gpu.sh probe           # per half-layer memory at 256K-1M, head / MoE / step profiles
#   bash benchmarks/learner/run_gpu.sh probe-1m single # per half-layer memory at 1M; one update of a 1M episode
#   bash benchmarks/learner/run_gpu.sh steady global-512k  # 16K/64K steady state + 256K single, both layouts; all-MLA 512K
#   bash benchmarks/learner/run_gpu.sh steady-compile  # 16K/64K steady state, token-local modules compiled
#   bash benchmarks/learner/run_gpu.sh steady-ab short  # 64K eager then compiled; the short-length kernel checks
#   bash benchmarks/learner/run_gpu.sh steady-norecompute  # 64K compiled without gradient checkpointing
#   bash benchmarks/learner/run_gpu.sh warm kernels    # tests beside the table's compiles; then the table vs fla
#   bash benchmarks/learner/run_gpu.sh table head      # the table vs fla (compiles sharded, nothing beside); heads
#   TESTS_FILES=tests/test_kernels_gpu.py bash benchmarks/learner/run_gpu.sh fixes  # kernel tests; ours on 4 rows
#   SHAPE_IDX="3 6 2" METHODS="ours fla" bash benchmarks/learner/run_gpu.sh fixes  # GPU tests; 3 rows, ours and fla
#   SHAPE_IDX="0 1 2 3 4 5 6 7" bash benchmarks/learner/run_gpu.sh fixes packed-profile  # + where a packed row's time goes
#   RECOMPUTE_LAYERS="3 6" bash benchmarks/learner/run_gpu.sh steady-partial  # 64K, 3 (then 6) of 12 layers recomputed
#   TOKENS=262144 RECOMPUTE_LAYERS=auto bash benchmarks/learner/run_gpu.sh steady-partial  # one update of 4+1 64K rows
#   RECOMPUTE_LAYERS=auto HEADS="fused checkpointed" bash benchmarks/learner/run_gpu.sh steady-partial profile-fp32-256
#   SHAPE_IDX="2 8" METHODS="ours fla" TESTS_FILES=tests/test_kernels_gpu.py bash benchmarks/learner/run_gpu.sh fixes accuracy
#   SHAPE_IDX="3 6" METHODS=ours bash benchmarks/learner/run_gpu.sh rows  # 2 rows timed on the carried caches alone
#   bash benchmarks/learner/run_gpu.sh layers          # where each layer kind's time goes at 64K (top kernels)
#   bash benchmarks/learner/run_gpu.sh ab              # kernels vs an earlier revision's (.before, see the group)
#   AB_MID=.mid TESTS_FILES=tests/test_kernels_gpu.py bash benchmarks/learner/run_gpu.sh tests ab  # benchmarks/kernels/candidates
#   BENCH_ARGS=--memory-trace bash benchmarks/learner/run_gpu.sh single  # 1M update, memory at each half-layer
#   bash benchmarks/learner/run_gpu.sh moe-layer steady-partial  # MoE layer A/B (gather-sums); then the 64K update
#
# Needs, in .whl/ (carried): deepspeed 0.19.8 (`pip wheel --no-deps deepspeed==0.19.8`), pydantic 2.14.4,
# pydantic_core 2.50.5 (cp312), annotated-types, typing-inspection, hjson, fla-core 0.6.0 (for the kernel table).
# Triton's and Inductor's compile caches are kept in .tcache/ (carry it to the next call: `tcache.tgz` comes back in $OUT).
# Each step has its own time limit, clipped to what is left of BUDGET_S (default 560 s, under the device tool's
# 600 s per command, the rest for packing what comes back), and writes its log and results under $OUT (or ./gpu-out).
set -u
BUDGET_S=${BUDGET_S:-560}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the cache comes back in parts of < 16 MiB (the device tool's limit per file): tcache.tgz.part-aa, -ab, ...
mkdir -p .tcache && ls .tcache/tcache.tgz* >/dev/null 2>&1 && cat .tcache/tcache.tgz* | tar -xzf - -C .tcache && rm -f .tcache/tcache.tgz*
export TRITON_CACHE_DIR=$PWD/.tcache/triton TRITON_CACHE_AUTOTUNING=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.tcache/inductor
# DeepSpeed's JIT-built ops (FusedAdam); its builder cannot parse an arch list with 9.0a in it
export TORCH_EXTENSIONS_DIR=$PWD/.tcache/torch_extensions TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

left() {  # left LIMIT: LIMIT clipped to the seconds left of BUDGET_S
    local rest=$((BUDGET_S - SECONDS))
    echo $(($1 < rest ? $1 : rest))
}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 asked=$2 limit; limit=$(left "$2"); shift 2
    if ((limit < asked && limit < 20)); then echo "=== $name: skipped, ${limit}s left of the ${BUDGET_S}s budget"; return; fi
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0))s"
    tail -n 25 "$OUT/$name.log"
}

warm_kernels() {  # warm_kernels SECONDS ROWS METHODS: compile the table's rows ROWS ("all", or indices) for each
    # of METHODS (ours, fla) in parallel: one process per row and method, fla's in FLA_SHARDS (default 3) processes
    # per row that compile a share of each kernel's autotuning configs each (fla's fp32 K=V=256 row alone compiled
    # for 460-490 s in one process; 8 rows in 4 shards each compiled in 135 s on an H100), at most WARM_PROCS
    # (default 16, the machine's cores) at once: 40 processes ran out of an H100's 80 GB, 36 out of an H200's
    # 139 GB (session 24: 5 of fla's shards failed, and the timed table then compiled them itself)
    local i m j n t0=$SECONDS limit rest rows=$2 pids=()
    limit=$(left "$1")
    [[ $rows == all ]] && rows=$(python3 -c "from marathon.commands.bench_kernels import SHAPES; print(*range(len(SHAPES)))")
    echo "=== warm kernels: rows $rows x ($3), ${WARM_PROCS:-16} at a time (limit ${limit}s)"
    for i in $rows; do
        for m in $3; do
            n=1; [[ $m == fla ]] && n=${FLA_SHARDS:-3}
            for ((j = 0; j < n; j++)); do
                while (($(jobs -rp | wc -l) >= ${WARM_PROCS:-16})); do wait -n; done
                rest=$((t0 + limit - SECONDS))
                if ((rest < 10)); then echo "=== warm kernels: row $i $m $j not started, ${rest}s left"; continue; fi
                timeout --signal=INT "$rest" python3 -m marathon.commands.bench_kernels --shapes --warm \
                    --warm-shard "$j/$n" --shape-index "$i" --method $m --out "$OUT/kernels-warm" \
                    > "$OUT/kernels-warm-$i-$m-$j.log" 2>&1 &
                pids+=($!)
            done
        done
    done
    wait "${pids[@]}" 2>/dev/null  # its own processes only (tests-kernels runs the tests beside them)
    echo "=== warm kernels: done after $((SECONDS - t0))s"; tail -q -n 1 "$OUT"/kernels-warm-*.log
    # autotuning timings taken beside the compiles pick nothing: the timed run autotunes alone on the GPU
    find .tcache/triton -name '*.autotune.json' -delete
}

gpu_tests() {  # TESTS_FILES: a subset of the three files
    step tests "${TESTS_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 --dist loadgroup \
        ${TESTS_FILES:-tests/test_kernels_gpu.py tests/test_model_gpu.py tests/test_model_varlen.py}
}

table_rows() {  # the rows SHAPE_IDX timed for each of METHODS (after their warm_kernels, nothing else on the GPU)
    local i m idx=()
    for i in ${SHAPE_IDX:-2 3 6 7}; do idx+=(--shape-index "$i"); done
    for m in ${METHODS:-ours}; do idx+=(--method "$m"); done
    step kernels-rows 180 python3 -m marathon.commands.bench_kernels --shapes "${idx[@]}" --out "$OUT/kernels-rows"
}

kernel_table() {
    step kernels 240 python3 -m marathon.commands.bench_kernels --shapes --out "$OUT/kernels"
}

for group in "$@"; do
    case $group in
    learner)
        step learner 450 python3 -m marathon.commands.bench_learner --layouts hybrid \
            --tokens 16384,65536 --single 1048576 --max-step-s 100000 --out "$OUT/learner" ;;
    learner-packed)
        step learner 500 python3 -m marathon.commands.bench_learner --layouts hybrid \
            --tokens 16384,65536,262144,1048576 --single 1048576 --max-step-s 400 --out "$OUT/learner" ;;
    tests)  # the kernel, model and learner checks, 8 pytest workers (each (dtype, head dim) pays a Triton compile)
        gpu_tests ;;
    warm)  # the table's compiles and the GPU tests side by side: correctness only, nothing here is timed
        gpu_tests &
        warm_kernels 520 all "ours fla"
        wait ;;
    table)  # the table vs fla: compiled first (sharded, nothing beside), then each autotuned alone on the GPU
        warm_kernels 330 all "ours fla"
        kernel_table ;;
    fixes)  # the table's fp32 and packed rows (and the unpacked one beside it) next to the kernel tests; ours, or
        # METHODS="ours fla" (both timed on the same card)
        gpu_tests &
        warm_kernels 300 "${SHAPE_IDX:-2 3 6 7}" "${METHODS:-ours}"
        wait  # the tests too: the table is timed alone
        table_rows ;;
    rows)  # the rows SHAPE_IDX timed for METHODS on what the carried cache holds (no warm, no tests)
        table_rows ;;
    packed-profile)  # per-kernel device times of ours on a 64K row, whole and cut into the table's ragged episodes
        step packed-profile 120 python3 benchmarks/kernels/breakdown.py --tokens 65536 --packed --no-fla \
            --skip accuracy --out "$OUT/packed-profile" ;;
    steady-partial)  # a 64K row compiled with only the first n of 12 layers recomputed, n in RECOMPUTE_LAYERS,
        # with each logprob head in HEADS (fused, the default, and/or checkpointed); TOKENS (default 65536) in rows
        # of at most MB_TOKENS (default 65536): TOKENS=262144 is one update of 5 micro-batches (4 of ~64K);
        # ZERO_STAGE (default 0): the learner's DeepSpeed ZeRO stage; STEADY_S: its limit (default 250: a fresh
        # machine compiles for over 190 s before the first update); BENCH_ARGS: more flags for the bench
        # (`--layer-times-max-tokens 0`: no per-layer times, ~a minute less)
        for n in ${RECOMPUTE_LAYERS:-3}; do
            for head in ${HEADS:-fused}; do
                flag=(); [[ $head == checkpointed ]] && flag=(--checkpointed-head)
                step steady-partial-$n-$head "${STEADY_S:-250}" python3 -m marathon.commands.bench_learner --layouts hybrid \
                    --compile "${flag[@]}" --recompute-layers "$n" --tokens "${TOKENS:-65536}" \
                    --micro-batch-tokens "${MB_TOKENS:-65536}" --single 0 --max-step-s 120 --zero-stage "${ZERO_STAGE:-0}" \
                    --out "$OUT/steady-partial-$n-$head" ${BENCH_ARGS:-}
            done
        done ;;
    ab)  # this tree's kernels against an earlier revision's, in one process per shape (.before/kernels, made where git
        # is with `git archive REV kernels | tar -x -C .before` and carried): fwd and fwd+bwd ms and per-kernel device
        # times of both; with AB_FLA=1, at the table's first shape also fla's (its compile took 191 s on an H100)
        # and every method's accuracy against fp64
        # (the table's first row, its slowest against fla on the H200; fp32 K=V=256, its slowest on the H100; K=V=128);
        # with AB_MID=DIR (another kernels/ tree, carried), also the first shape against DIR's kernels, second
        for s in "4 8192 32 64 bf16" "1 32768 8 256 fp32" "1 65536 16 128 bf16"; do
            read -r b t h d dt <<< "$s"
            more=(--no-fla --skip accuracy); limit=120
            ((d == 64 && ${AB_FLA:-0})) && more=(--check-heads 32 --check-head-dim 64) && limit=240
            for dir in .before ${AB_MID:-}; do
                [[ $dir != .before && $d != 64 ]] && continue
                name=ab-$h-$d-$dt; [[ $dir != .before ]] && name=ab-mid-$h-$d-$dt && more=(--no-fla --skip accuracy)
                step "$name" "$limit" python3 benchmarks/kernels/breakdown.py --batch "$b" --tokens "$t" \
                    --heads "$h" --head-dim "$d" --dtype "$dt" --compare "$dir" "${more[@]}" --out "$OUT/$name"
            done
        done ;;
    moe-layer)  # one MoE layer at 64K: the gather-sums as PyTorch ops vs the Triton kernel, alternating in one process
        step moe-layer 150 python3 benchmarks/model/moe_layer.py --tokens 65536 --out "$OUT/moe-layer" ;;
    profile-fp32-256)  # per-kernel device times of ours on the table's fp32 K=V=256 row (B1 H8 T32K)
        step profile-fp32-256 120 python3 benchmarks/kernels/breakdown.py --tokens 32768 --heads 8 --head-dim 256 \
            --dtype fp32 --no-fla --skip accuracy --out "$OUT/profile-fp32-256" ;;
    accuracy)  # every output's and gradient's error against fp64 (4K tokens) at each head dim of ACC_DIMS (default
        # 128 256), heads as in the table's rows (fla compiles per head count): ours and fla in bf16 and in fp32
        # (fla's fp32 dots are TF32), ours also at float32 matmul precision "high" (TF32)
        for d in ${ACC_DIMS:-128 256}; do
            h=16; ((d == 256)) && h=8; ((d == 64)) && h=32
            step accuracy-$d 150 python3 benchmarks/kernels/breakdown.py --skip profile --check-tokens 4096 \
                --check-heads $h --check-head-dim "$d" --out "$OUT/accuracy-$d"
        done ;;
    kernels)  # the table vs fla: compiled first, one process per shape at once, then timed one shape after another
        warm_kernels 300 all "ours fla"
        kernel_table ;;
    tests-kernels)  # both at once: the tests' workers and the table's compiles share the machine's 16 cores
        gpu_tests &
        warm_kernels 300 all "ours fla"
        wait
        kernel_table ;;
    head)
        step head 90 python3 benchmarks/learner/logprob_head.py --device cuda --tokens 16384,65536 \
            --chunked-tokens "" --vocab 163840 --hidden 2048 --out "$OUT" ;;
    global)
        step global 240 python3 -m marathon.commands.bench_learner --layouts global --tokens 16384,65536 \
            --single 1048576 --max-step-s 200 --out "$OUT/global" ;;
    probe)
        step probe 240 python3 benchmarks/learner/gpu_probe.py memory head moe profile --out "$OUT/probe" ;;
    step-probe)  # the optimizer step alone (DeepSpeed bf16 engine) and its kernels, against a fused AdamW floor
        # at each ZeRO stage of ZERO_STAGES (default 0; e.g. "0 0u 0d 1 2 1f": 0 the learner's FlatAdamW, 0u torch's
        # AdamW in DeepSpeed's per-parameter wrapper, 0d DeepSpeed's FusedAdam, 1f ZeRO-1 accumulating fp32
        # gradients), one process each (an engine's memory is not all freed in its process: the next one would run
        # beside it)
        for z in ${ZERO_STAGES:-0}; do
            step step-probe-$z 240 python3 benchmarks/learner/gpu_probe.py step --zero-stages "$z" \
                --out "$OUT/step-probe-$z"
        done ;;
    layers)  # one layer of each kind on a packed 64K row, compiled: fwd / bwd ms and its top kernels
        step layers 200 python3 benchmarks/learner/gpu_probe.py layers --out "$OUT/layers" ;;
    probe-1m)
        step probe-1m 170 python3 benchmarks/learner/gpu_probe.py memory moe --lengths 1048576 \
            --mla-lengths 1048576 --segments 262144 --out "$OUT/probe-1m" ;;
    single)  # one update of a single episode of SINGLE tokens (default 1048576); BENCH_ARGS: more bench flags
        step single 420 python3 -m marathon.commands.bench_learner --layouts hybrid --tokens "" --single "${SINGLE:-1048576}" \
            --max-step-s 100000 --repeats 1 --layer-times-max-tokens 0 --out "$OUT/single" ${BENCH_ARGS:-} ;;
    steady)
        step steady 420 python3 -m marathon.commands.bench_learner --layouts hybrid,global --tokens 16384,65536 \
            --single 262144 --max-step-s 120 --out "$OUT/steady" ;;
    steady-compile)  # the 16K / 64K steady state with the token-local modules compiled (learner/compile.py)
        step steady-compile 420 python3 -m marathon.commands.bench_learner --layouts hybrid --compile \
            --tokens 16384,65536 --single 0 --max-step-s 120 --out "$OUT/steady-compile" ;;
    short)  # the short-length checks alone, one process, every launch synchronous (a fault names its kernel)
        step short 110 env CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -x -q -p no:cacheprovider tests/test_kernels_gpu.py \
            -k "short_sequences" ;;
    steady-ab)  # 64K eager, then 16K / 64K with learner.compile and rows under 24K not recomputed, in one call
        step steady-eager 170 python3 -m marathon.commands.bench_learner --layouts hybrid --tokens 65536 --single 0 \
            --max-step-s 120 --layer-times-max-tokens 0 --out "$OUT/steady-eager"
        step steady-fast 280 python3 -m marathon.commands.bench_learner --layouts hybrid --compile \
            --recompute-min-tokens 24576 --tokens 16384,65536 --single 0 --max-step-s 120 --out "$OUT/steady-fast" ;;
    steady-norecompute)  # a 64K row compiled and not recomputed: does it fit in the 139 GiB, and how fast is it
        step steady-norecompute 300 python3 -m marathon.commands.bench_learner --layouts hybrid --compile \
            --recompute-min-tokens 131072 --tokens 65536 --single 0 --max-step-s 120 --out "$OUT/steady-norecompute" ;;
    global-512k)
        step global-512k 300 python3 -m marathon.commands.bench_learner --layouts global --tokens "" --single 524288 \
            --max-step-s 100000 --repeats 1 --layer-times-max-tokens 0 --offload-tokens 524288 --out "$OUT/global-512k" ;;
    *) echo "unknown group $group"; exit 2 ;;
    esac
done
# at most 8 files come back from a call: the logs and results in one archive, the compile cache in parts; a
# later run_gpu.sh in the same call (same $OUT) writes results-2.tgz, results-3.tgz, ... beside the first
archive=results.tgz
for ((k = 2; k < 100; k++)); do [[ -e $OUT/$archive ]] || break; archive=results-$k.tgz; done
(cd "$OUT" && tar -czf "$archive" --exclude 'results*.tgz' --exclude 'tcache.tgz.part-*' * && \
    find . -mindepth 1 ! -name 'results*.tgz' ! -name device.txt -delete)
python3 - <<'EOF'  # the compile cache without its IR and PTX (a cache hit loads the json and the cubin)
import json, pathlib
for grp in pathlib.Path(".tcache/triton").glob("*/__grp__*.json"):
    data = json.loads(grp.read_text())
    kids = data.get("child_paths", {})
    for name in [n for n in kids if pathlib.Path(n).suffix in (".llir", ".ttir", ".ttgir", ".source", ".ptx")]:
        (grp.parent / name).unlink(missing_ok=True)
        del kids[name]
    grp.write_text(json.dumps(data))
EOF
# its first CACHE_PARTS parts (default 3, 45 MiB) only: a call returns at most about 64 MiB, and which files it
# leaves out is not ours to choose (the results archives must come back); a cut archive still extracts up to the cut
tar -czf - -C .tcache triton inductor torch_extensions 2>/dev/null | split -b 15M - "$OUT/tcache.tgz.part-"
ls "$OUT"/tcache.tgz.part-* | tail -n +$((${CACHE_PARTS:-3} + 1)) | xargs -r rm -f
ls -la "$OUT"
