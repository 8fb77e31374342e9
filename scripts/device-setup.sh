#!/usr/bin/env bash
# Set-up on the lent GPU machine (no network there): install this tree, the wheels carried in
# .whl/ (transformers 5.24, to match the CPU machines) into /tmp/site, and vLLM 0.26 from the
# parts earlier calls copied to /tmp/vparts/ (../shared/FACTS.md) into /tmp/site-vllm. With this tree
# (~5 MB) a 60 MiB part no longer fits a call's 64 MiB: re-split the wheel with
# `split -b 45M -d -a 1 WHEEL part` (seven parts, carried one a call; session 10). The call that installs
# carries `.vllm/small` and `.vllm/vllm.sha256` (the join is checked against it). A file edited on the machine
# stays edited in later calls on the same warm machine while it is unchanged here (session 12).
# Usage there: source scripts/device-setup.sh   (then `vlmbatch bench ...`; see BENCHMARKS.md)
# Beyond ../shared/tools/vllm-peer-wheels.txt, vLLM's structured outputs and FP8 checkpoints import
# lm-format-enforcer 0.11.3, interegular 0.3.3, pyyaml, outlines_core 0.2.14, compressed-tensors 0.17.0
# and loguru; its LLaVA-NeXT/OneVision models import mistral_common (>= 1.11.5, with pydantic-extra-types,
# tiktoken, regex, jsonschema with its four dependencies, pycountry and sentencepiece: `import vllm` fails on
# MistralCommonBackend without the last two, session 11):
# download those (cp312 manylinux) into .vllm/small too.
set -e
export PYTHONSAFEPATH=1  # the checkout's kernels/ must not shadow Hugging Face's `kernels` (scripts/test.sh)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
# A later call on the same warm machine need not carry .whl again (the carry limit is 64 MiB).
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi
if [ -d /tmp/vparts ] && [ -d .vllm/small ] && [ ! -d /tmp/site-vllm/vllm ]; then
  wheel=/tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
  cat $(ls /tmp/vparts/part* | sort -V) > "$wheel"
  echo "$(cut -d' ' -f1 .vllm/vllm.sha256)  $wheel" | sha256sum -c --quiet
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-vllm .vllm/small/*.whl "$wheel"
fi
# SmolVLM's processor (ours and vLLM's) needs num2words, which the machine lacks.
if ls .whl/num2words-*.whl >/dev/null 2>&1 && [ -d /tmp/site-vllm/vllm ] && [ ! -d /tmp/site-vllm/num2words ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-vllm .whl/num2words-*.whl
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
set +e
