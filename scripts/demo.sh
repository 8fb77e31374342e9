#!/usr/bin/env bash
# The demo job: a tiny Qwen2.5-VL checkpoint over jobs/demo/images.jsonl, in-process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -f .tiny/qwen2_5_vl/config.json ] || vlmbatch make-tiny-model .tiny/qwen2_5_vl --arch qwen2_5_vl
vlmbatch submit jobs/demo/images.jsonl --model .tiny/qwen2_5_vl --output out --max-tokens 16 "$@"
