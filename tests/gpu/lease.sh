#!/usr/bin/env bash
# The lease script's two steps, so that a lent GPU machine's 15 minutes go to the check itself.
#
#   tests/gpu/lease.sh prepare   here, with the network and the venv (`make setup`): the
#                                daemon's Python packages the lent machine lacks, as wheels for
#                                its Python 3.12 (.whl/, ignored), and protos/*_pb2*.py made
#   tests/gpu/lease.sh run       there, in one device call, carrying what `prepare` printed:
#                                installs the wheels under /tmp/site (no network there), then
#                                python3 tests/gpu/check_gpu.py; $OUT/gpu_summary.json
#
# The lent machine has torch 2.11, triton 3.6, numpy, pyyaml, aiohttp, prometheus-client,
# onnxruntime and cuda-bindings (/work/.library/device/KINDS.md); not our pins of grpcio and
# protobuf, nor tritonclient.
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEELS=(grpcio==1.81.1 protobuf==6.33.6 grpcio-health-checking==1.81.1
        grpcio-reflection==1.81.1 tritonclient==2.73.0 python-rapidjson==1.23 orjson==3.13.0)
PROTOS=(protos/cuvil_pb2.py protos/cuvil_pb2_grpc.py protos/inference_pb2.py
        protos/inference_pb2_grpc.py)

case "${1:-}" in
prepare)
    make -s setup
    rm -rf .whl && mkdir .whl
    for w in "${WHEELS[@]}"; do
        .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
            --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux1_x86_64 -d .whl "$w"
    done
    du -sh .whl
    printf 'carry: [".whl"'; printf ', "%s"' "${PROTOS[@]}"; printf ']\n'
    echo 'command: bash tests/gpu/lease.sh run'
    ;;
run)
    for p in "${PROTOS[@]}"; do
        test -f "$p" || { echo "lease: $p missing: carry it (tests/gpu/lease.sh prepare)"; exit 2; }
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    exec python3 tests/gpu/check_gpu.py "${@:2}"
    ;;
*)
    echo "usage: tests/gpu/lease.sh prepare | run [check_gpu.py options]" >&2
    exit 2
    ;;
esac
