#!/usr/bin/env bash
# Installs everything vlmbatch and its tests need on a fresh Debian machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v ffmpeg >/dev/null 2>&1 || missing+=(ffmpeg)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]} from apt"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# torch + torchvision first, pinned to the CUDA build that runs on the CPU here too
# (transformers' Qwen2.5-VL processor needs torchvision; torchcodec 0.17 needs this torch).
if ! python3 -c 'import torch, torchvision' >/dev/null 2>&1; then
  python3 -m pip install -q torch==2.14.1 torchvision==0.29.1
fi
# The editable install, skipped when this checkout's is in place for the same pyproject.toml
# (a no-op `pip install` still takes ~11 s, which every demo run would pay).
stamp=".tiny/setup-stamp"
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ] \
   || ! PYTHONSAFEPATH=1 python3 -c 'import os, sys, vlmbatch.cli; sys.exit(os.path.dirname(vlmbatch.__file__) != os.path.abspath("vlmbatch"))' >/dev/null 2>&1; then
  python3 -m pip install -q -e '.[all,test]'
  mkdir -p .tiny && echo "$wanted" > "$stamp"
fi
