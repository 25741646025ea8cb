#!/bin/bash
# What every whole-stack run on the H200 carries (the device machine has Python 3.12 with torch,
# transformers and peft, and no network): this machine's node (xz), redis-server with the libraries
# it loads, the production node_modules, the tinker SDK's wheels for Python 3.12 (under whl/sdk), and
# under whl/sdkdeps those of its dependencies the device's Python lacks (the vLLM kit brings its own
# in its overlay). Built once into WORKDIR and kept.
#   bash bench/gpu/build_stack_carry.sh WORKDIR
set -e
W=${1:?usage: build_stack_carry.sh WORKDIR}
mkdir -p "$W"
[ -f "$W/node.xz" ] || xz -9 -T0 -c "$(readlink -f "$(command -v node)")" > "$W/node.xz"
if [ ! -f "$W/redis.tar.xz" ]; then
  rm -rf "$W/redis" && mkdir -p "$W/redis"
  cp "$(command -v redis-server)" /lib/x86_64-linux-gnu/liblzf.so.1 /lib/x86_64-linux-gnu/libjemalloc.so.2 /lib/x86_64-linux-gnu/libatomic.so.1 "$W/redis/"
  tar -C "$W" -cJf "$W/redis.tar.xz" redis
fi
if [ ! -f "$W/nm.tar.xz" ]; then
  rm -rf "$W/nm" && mkdir -p "$W/nm" && cp package.json package-lock.json "$W/nm/"
  (cd "$W/nm" && npm ci --omit=dev --ignore-scripts --no-audit --no-fund && tar -cf - node_modules | xz -9 -T0 > "$W/nm.tar.xz")
fi
PLAT=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp)
for m in 17 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${m}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64)
[ -d "$W/whl/sdk" ] || python3 -m pip download -q "${PLAT[@]}" -d "$W/whl/sdk" \
  tinker==0.38.0 pyqwest==0.12.0 orjson==3.13.0 zstandard==0.25.0 distro==1.9.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
[ -d "$W/whl/sdkdeps" ] || python3 -m pip download -q "${PLAT[@]}" -d "$W/whl/sdkdeps"   pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 sniffio==1.3.1 protobuf==7.36.2
