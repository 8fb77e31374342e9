#!/usr/bin/env bash
# The demo job: a tiny Qwen2.5-VL checkpoint over jobs/demo/images.jsonl, in-process.
# VLMBATCH_OUTPUT_DIR (default ./out) and VLMBATCH_DEMO_MODEL (default ./.tiny/qwen2_5_vl) move its files.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
model="${VLMBATCH_DEMO_MODEL:-.tiny/qwen2_5_vl}"
[ -f "$model/config.json" ] || vlmbatch make-tiny-model "$model" --arch qwen2_5_vl
vlmbatch submit jobs/demo/images.jsonl --model "$model" --output "${VLMBATCH_OUTPUT_DIR:-out}" --max-tokens 16 "$@"
