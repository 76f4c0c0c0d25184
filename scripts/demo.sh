#!/usr/bin/env bash
# The main job on an embedded default: prepare an offline corpus (the Python standard library's source),
# generate a DeepSpeed config for a small GPT, train it with the deepspeed launcher on the GPUs present
# (bf16, NCCL) or on 2 CPU ranks (fp32, gloo), and show the loss falling.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RUN=${RUN:-runs/demo}
STEPS=${STEPS:-300}
dspipe prepare-data --out data/stdlib --train-tokenizer 4096
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -gt 0 ]; then
  CLUSTER=(--gpus-per-node "$GPUS" --gpu "${GPU:-h100-80g}" --precision bf16 --micro-batch 8)
  NPROC=$GPUS
else
  # bf16 matmuls are ~10x slower than fp32 on CPUs without AVX512-BF16, so the CPU demo trains in fp32.
  CLUSTER=(--gpus-per-node 2 --gpu cpu --precision fp32 --micro-batch 8)
  NPROC=2
fi
dspipe gen-config --model tiny --layers 4 --hidden 128 --heads 4 --seq-len 128 --vocab 4096 \
  "${CLUSTER[@]}" --global-batch $((16 * NPROC)) --steps "$STEPS" --warmup 20 --lr 2e-3 --zero 1 \
  --log-interval 25 --eval-interval 50 --data data/stdlib --out "$RUN" --force
deepspeed --num_gpus "$NPROC" run.py --run "$RUN" --restart  # a re-run trains afresh; earlier outputs move to previous/
dspipe report "$RUN"
echo "run directory: $RUN (ds_config.json, dspipe.json, engine.json, metrics.csv, val_metrics.csv, checkpoints/, monitor/, report/)"
