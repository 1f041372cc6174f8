#!/usr/bin/env bash
# Builds the folders that carry flash-attn-4 and its CuTe DSL runtime to a GPU machine without
# network (the workplace's device machine). Why two: the runtime's CUDA 13 wheel is 92 MB and
# one call carries at most 64 MiB, so it travels in two halves over two calls on one warm machine.
#
#   bash bench/fa4_carry.sh              # downloads the wheels, writes .fa4a/ and .fa4b/
#   call 1, carry .fa4a:  mkdir -p /tmp/fa4 && cp .fa4a/part.aa /tmp/fa4/
#   call 2, carry .fa4b:  source .fa4b/install.sh && python bench/mfu.py ...
#                         (or: python3 -m pytest -m gpu tests/train)
#
# install.sh joins the halves, unpacks every wheel into /tmp/site and sets PYTHONPATH (the
# cutlass wheel's .pth is not read from a --target folder, so its path is added by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b/wheels
platforms=""
for n in 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 -d .fa4b/wheels \
    flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
    msgspec==0.23.0  # not FA4's: our sampler client's, which GPU test files import
big=$(ls .fa4b/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl)
split -n 2 -d "$big" .fa4b/part.
mv .fa4b/part.00 .fa4a/part.aa && mv .fa4b/part.01 .fa4b/part.ab
basename "$big" > .fa4b/big_wheel_name && rm "$big"
cat > .fa4b/install.sh <<'EOF'
# Sourced on the GPU machine after call 1 left /tmp/fa4/part.aa there.
python3 -c "import flash_attn.cute" 2>/dev/null && return 0
cat /tmp/fa4/part.aa .fa4b/part.ab > "/tmp/fa4/$(cat .fa4b/big_wheel_name)" || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .fa4b/wheels/*.whl /tmp/fa4/*.whl || return 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/core:$PWD/bench
python3 -c "import flash_attn.cute; print('flash-attn-4 ready')"
EOF
du -sh .fa4a .fa4b
