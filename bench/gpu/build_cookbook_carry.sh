#!/bin/bash
# What bench/gpu/recipes_check.sh and turns_check.sh's `trl` way need beside the vLLM kit
# (bench/gpu/build_vllm_sdk_carry.sh): the Tinker Cookbook (0.6.1, as scripts/setup.sh installs it,
# without its declared dependencies), TRL 1.16.0 with accelerate 1.16.0 (the anchor of issue 31 item 5,
# bench/gpu/trl_grpo.py), and those of their imports the offline H200 machine lacks, as cp312 wheels in
# the git-ignored folder .carry-cb/whl (about 6 MiB). The cookbook's versions are
# test/e2e/requirements.txt's. The machine already has
# pandas, pyarrow, aiohttp, sympy, tiktoken, rich, cloudpickle, pillow, fsspec, xxhash and lxml.
#
#   bash bench/gpu/build_cookbook_carry.sh
# Runs on a networked machine (pip).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -q '^/.carry-\*/$' .git/info/exclude 2>/dev/null || echo '/.carry-*/' >> .git/info/exclude
rm -rf .carry-cb && mkdir -p .carry-cb/whl
PLAT=(--no-deps --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux_2_28_x86_64 --platform any -d .carry-cb/whl)
# Pure-Python wheels first; a package the index has only as a source archive is built into a wheel.
for spec in tinker-cookbook==0.6.1 chz==0.4.0 datasets==5.2.0 blobfile==3.3.0 termcolor==3.3.0 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 dill==0.4.1 \
  multiprocess==0.70.19 pycryptodomex==3.24.2 pylatexenc==2.11 trl==1.16.0 accelerate==1.16.0; do
  python3 -m pip download -q --only-binary=:all: "${PLAT[@]}" "$spec" 2>/dev/null ||
    python3 -m pip wheel -q --no-deps -w .carry-cb/whl "$spec"
done
(cd .carry-cb && sha256sum whl/* > SHA256SUMS)
du -sh .carry-cb && ls .carry-cb/whl
