#!/usr/bin/env bash
# Check a GPU machine in about 5 minutes: CUDA-only tests, SyncBN over nccl against plain BN
# (fp32 and autocast) and a 2-rank nccl train.py run when 2 GPUs exist, parallel=fsdp2 (bf16,
# nccl) on the lm_bytes GPT with its memory against DDP's, and ResNet-18 images/s for
# amp=off/bf16/fp16 at 32x32 and 224x224. Nothing passes by construction: on one rank
# torch's SyncBN is plain BN, so with fewer than 2 GPUs the script says what it did not run.
#
#   benchmarks/gpu_check.sh                    # on the GPU machine
#   GPU_CHECK_DRY=1 benchmarks/gpu_check.sh    # dry check on a CPU-only machine (tiny sizes,
#                                              # gloo, CUDA-only parts skipped), 2-3 minutes
#
# Knobs (env): NUM_WORKERS (DataLoader workers, default 8), STEPS (steps per epoch, default 40),
# RUN_TIMEOUT (seconds per train.py run, default 240), GPU_CHECK_KEEP=1 keeps the run dirs.
#
# images/s is perf/samples_per_s of the LAST epoch in <run_dir>/rank0/metrics.jsonl: epoch 0
# pays for CUDA/cuDNN start-up, allocator growth and the workers' first batches. log_every is
# STEPS: the interval log at the last step of each epoch reads the loss (.item()), which waits
# for the GPU, so the epoch's clock stops only after its last step really ran, and no other
# step waits for the host.
#
# Data loading limit: data=synthetic generates every sample on the fly in the DataLoader
# workers (a torch.Generator and a randn per item). At 32x32 that is ~40k samples/s per worker
# core, far more than any GPU needs. At 224x224 it is ~1.7k samples/s per worker core measured
# on an idle laptop core (~0.6k on a loaded one), and each 600 KB sample is then collated into
# shared memory and copied into pinned memory; 8 workers give very roughly 10k samples/s, which
# is of the order of what ResNet-18 reaches on a recent GPU. The "data wait" column (share of
# the epoch spent waiting for the loader) says when 224x224 numbers are data-bound rather than
# GPU-bound: then raise NUM_WORKERS (cores permitting) before reading them as GPU speed.
set -euo pipefail

cd "$(dirname "$0")/.."
START=$SECONDS
DRY=${GPU_CHECK_DRY:-0}
PY=.venv/bin/python
RUN_TIMEOUT=${RUN_TIMEOUT:-240}

step() { printf '\n==== [%3ds] %s ====\n' "$((SECONDS - START))" "$*"; }

if [[ "$DRY" == 1 ]]; then
    SIZES=(16 64)          # 16: the CIFAR stem (< 64 px), 64: the ImageNet stem, like 224
    BATCH=8 STEPS=${STEPS:-3} NUM_WORKERS=${NUM_WORKERS:-1} BACKEND=gloo
else
    SIZES=(32 224)
    BATCH=128 STEPS=${STEPS:-40} NUM_WORKERS=${NUM_WORKERS:-8} BACKEND=nccl
fi

OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
if [[ "${GPU_CHECK_KEEP:-0}" != 1 ]]; then
    trap 'rm -rf "$OUT"' EXIT
fi
export WANDB_MODE=offline WANDB_SILENT=true

step "environment (venv as the Makefile builds it)"
if [[ ! -x "$PY" ]]; then
    make install
fi
"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"CUDA available {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability "
          f"{p.major}.{p.minor}, native bf16 {(p.major, p.minor) >= (8, 0)}")
EOF
if [[ "$DRY" == 1 ]]; then
    GPUS=0 HALF=bf16
else
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    # amp=bf16 is refused without native bf16 (compute capability < 8.0): fp16 there.
    HALF=$("$PY" -c 'import torch; print("bf16" if torch.cuda.get_device_capability() >= (8, 0) else "fp16")')
fi
GPU_WORDS="$GPUS GPU$( ((GPUS == 1)) || echo s)"  # for "not exercised (1 GPU)"
AMPS=(off fp16)
if [[ "$HALF" == bf16 ]]; then
    AMPS=(off bf16 fp16)
fi
SHM_GB=$(df -k /dev/shm | awk 'NR==2 {print int($4 / 1048576)}')
echo "run dirs under $OUT; dry=$DRY; $(nproc) CPU cores; /dev/shm ${SHM_GB} GiB free"
if [[ "$DRY" != 1 && "$SHM_GB" -lt 4 ]]; then
    # 8 workers x prefetch 4 x a 77 MB batch of 224x224 images is ~2.5 GB of shared memory.
    echo "WARNING: little /dev/shm; the 224x224 runs may die with a bus error (docker: --shm-size)"
fi
if [[ "$DRY" != 1 ]] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "CUDA is not available to torch: nothing to check here (GPU_CHECK_DRY=1 for a dry run)."
    exit 1
fi

step "CUDA-only tests (pytest -m gpu; a skip says why)"
if [[ "$DRY" == 1 ]]; then
    echo "skipped (dry run: no CUDA)"
else
    timeout "$((2 * RUN_TIMEOUT))" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests \
        -k "not syncbn_over_nccl"
fi

step "SyncBN over nccl, 2 ranks, vs plain BN on the whole batch (fp32 and amp=$HALF)"
if (( GPUS >= 2 )); then
    log=$(timeout "$RUN_TIMEOUT" "$PY" -m pytest -q -rs -p no:cacheprovider \
        tests/test_gpu.py::test_torch_syncbn_over_nccl_matches_plain_bn 2>&1) \
        || { echo "$log"; exit 1; }
    echo "$log" | tail -2
    echo "$log" | grep -q "2 passed" || { echo "FAILED: both cases must run and pass"; exit 1; }
else
    echo "nccl SyncBN not exercised ($GPU_WORDS)"
fi

finished() {  # a run's accuracy and its first log line: launcher, world, backend and why
    "$PY" - "$1" <<'EOF'
import json
import sys
from pathlib import Path

run_dir = Path(sys.argv[1])
s = json.loads((run_dir / "summary.json").read_text())
first = next(x for x in (run_dir / "train.log").open() if "launcher " in x)
metric = "accuracy" if "eval_accuracy" in s else "loss"
print(f"finished: eval {metric} {s['eval_' + metric]:.4f} on {s['world_size']} rank(s); "
      f"{first.split(' - ', 1)[-1].strip()}")
EOF
}

if (( GPUS >= 2 )); then
    step "train.py on 2 ranks over nccl (torchrun, syncbn=on, amp=$HALF)"
    RUN_ID=gpu-check-nccl2 timeout "$RUN_TIMEOUT" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node=2 train.py backend=nccl syncbn=on "amp=$HALF" epochs=1 logger=none \
        "paths.output_root=$OUT/outputs" "paths.multirun_root=$OUT/multirun"
    finished "$OUT/outputs/gpu-check-nccl2"
else
    step "train.py on 1 rank, backend=$BACKEND, syncbn=on (wiring only: 1-rank SyncBN is plain BN)"
    RUN_ID=gpu-check-1rank timeout "$RUN_TIMEOUT" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node=1 train.py "backend=$BACKEND" syncbn=on epochs=1 logger=none \
        "paths.output_root=$OUT/outputs" "paths.multirun_root=$OUT/multirun"
    finished "$OUT/outputs/gpu-check-1rank"
    echo "nccl 2-rank train.py run not exercised ($GPU_WORDS)"
fi

FSDP_AMP=off  # amp=fp16 is refused under parallel=fsdp2; bf16 is its mixed-precision policy
if [[ "$HALF" == bf16 ]]; then
    FSDP_AMP=bf16
fi
FSDP_RANKS=$(( GPUS >= 2 ? 2 : 1 ))
step "parallel=fsdp2 over $BACKEND (amp=$FSDP_AMP): the lm_bytes GPT on $FSDP_RANKS rank(s)"
RUN_ID=gpu-check-fsdp2 timeout "$RUN_TIMEOUT" "$PY" train.py experiment=lm_bytes parallel=fsdp2 \
    "backend=$BACKEND" "amp=$FSDP_AMP" "dist.nproc=$FSDP_RANKS" epochs=1 \
    "max_steps_per_epoch=$STEPS" logger=none "paths.output_root=$OUT/outputs" \
    "paths.multirun_root=$OUT/multirun" "paths.data_root=$OUT/data" > "$OUT/fsdp2.log" 2>&1 \
    || { tail -30 "$OUT/fsdp2.log"; exit 1; }
grep -h "fsdp2: fully_shard" "$OUT/fsdp2.log" | head -1 | sed 's/.* - //'
finished "$OUT/outputs/gpu-check-fsdp2"
if [[ "$DRY" != 1 ]]; then  # the slices and the optimizer state in CPU memory (CUDA only)
    RUN_ID=gpu-check-offload timeout "$RUN_TIMEOUT" "$PY" train.py experiment=lm_bytes \
        parallel=fsdp2 parallel.offload=true "backend=$BACKEND" "amp=$FSDP_AMP" \
        "dist.nproc=$FSDP_RANKS" epochs=1 "max_steps_per_epoch=$STEPS" logger=none \
        "paths.output_root=$OUT/outputs" "paths.multirun_root=$OUT/multirun" \
        "paths.data_root=$OUT/data" > "$OUT/offload.log" 2>&1 \
        || { tail -30 "$OUT/offload.log"; exit 1; }
    echo -n "parallel.offload=true: "
    finished "$OUT/outputs/gpu-check-offload"
fi
timeout "$((2 * RUN_TIMEOUT))" "$PY" benchmarks/fsdp2.py --backend "$BACKEND" --amp "$FSDP_AMP" \
    --worlds "$(seq -s, 1 "$FSDP_RANKS")" --rounds 3 --steps "$STEPS" --scratch "$OUT/fsdp2" \
    | sed -n '/^| W /,/^$/p'

step "ResNet-18 throughput on data=synthetic (batch $BATCH, $STEPS steps x 2 epochs)"
for size in "${SIZES[@]}"; do
    for amp in "${AMPS[@]}"; do
        id="bench-${size}px-${amp}"
        echo "-- $id"
        RUN_ID=$id timeout "$RUN_TIMEOUT" "$PY" train.py model=resnet18 data=synthetic \
            "data.image_size=$size" "data.size=$((BATCH * STEPS))" "data.test_size=$BATCH" \
            "amp=$amp" epochs=2 "max_steps_per_epoch=$STEPS" "loader.batch_size=$BATCH" \
            "loader.eval_batch_size=$BATCH" "loader.num_workers=$NUM_WORKERS" "log_every=$STEPS" \
            logger=none checkpoint.enabled=false "paths.output_root=$OUT/outputs" \
            "paths.multirun_root=$OUT/multirun" > "$OUT/$id.log" 2>&1 \
            || { tail -30 "$OUT/$id.log"; exit 1; }
    done
done

step "images/s (last epoch, rank 0)"
"$PY" - "$OUT/outputs" "${AMPS[*]}" "${SIZES[@]}" <<'EOF'
import json
import sys
from pathlib import Path

root, amps, sizes = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
print(f"{'image':>7} {'amp':>5} {'images/s':>10} {'vs off':>7} {'step ms':>8} {'data wait':>10}")
for size in sizes:
    base = None
    for amp in amps:
        rows = (json.loads(line) for line in
                (root / f"bench-{size}px-{amp}" / "rank0" / "metrics.jsonl").open())
        last = [r for r in rows if "perf/samples_per_s" in r][-1]
        ips = last["perf/samples_per_s"]
        base = base or ips
        wall = last["data/samples"] / ips
        print(f"{size + 'px':>7} {amp:>5} {ips:>10.0f} {ips / base:>6.2f}x "
              f"{last['perf/step_s'] * 1e3:>8.1f} {last['perf/data_wait_s'] / wall:>9.0%}")
EOF

step "done in $((SECONDS - START)) s"
