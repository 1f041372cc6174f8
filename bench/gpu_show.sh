#!/usr/bin/env bash
# Issue 23's "Show" runs on a GPU machine, by phase (each fits one 600 s device call):
#   a: the MFU bench twice on today's path, then once on the path of the issue's filing
#      (varlen, torch's flash kernel, the torch LM head tiles, inductor's SwiGLU): the
#      side-by-side ratio; 1.7B shape, 16k-token rows, G=8
#   b: the packing bench at 16k rows, then 8k rows with CUDA graphs off and on
# Carry flash-attn-4 first (bench/fa4_carry.sh's header), then: bash bench/gpu_show.sh a
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in a|b) ;; *) echo "usage: bash bench/gpu_show.sh a|b" >&2; exit 2 ;; esac
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
run() { echo "+ $*"; python3 "$@" 2>&1 | grep -v Warning; }
case "${1:-}" in
a) run bench/mfu.py --group-sizes 8 --backends masked --flash-impls FA4 --lm-heads auto \
       --dense off --repeats 5 --passes 2
   run bench/mfu.py --group-sizes 8 --backends varlen --flash-impls default --lm-heads torch \
       --dense off --swiglu off --repeats 5 ;;
b) run bench/packing.py --model qwen3-0.6b --compile --group-sizes 8 --rows 4 --repeats 10 \
       --token-budget 16384
   run bench/packing.py --model qwen3-0.6b --compile --group-sizes 8 --rows 4 --repeats 10 \
       --token-budget 8192 --graphs off,on --graph-steps 64:64,64:64:masked ;;
esac
