#!/usr/bin/env bash
# kvferry's CUDA tests on a machine with an NVIDIA GPU: staging of a GPU KV cache through pinned host
# mirrors (tests/vllm/test_vllm_layout.py, the tests named *cuda*), P and D over kvferry's real TCP data
# plane, stopping at the first failure (-x). vLLM is not needed: the tests drive kvferry's connector
# roles the way vLLM's model runner drives KVFerryConnector. Fails, rather than skips, without a GPU.
#
# Two kinds of machine:
# - Python with a CUDA build of torch already (a GPU image; the lent H200s: no network at all). Only
#   kvferry's missing runtime packages are needed; they go into $SITE with `pip install --target`, from
#   the wheels in $WHEELS when that folder exists (no index is asked), else from the package index.
#   kvferry itself is imported from this checkout's src/ (no build step).
# - Python and PyPI only: a venv in $VENV, `pip install torch` (PyPI's default wheel is a CUDA build;
#   ~3 GB with the nvidia-* wheels, most of the time) and kvferry's runtime packages.
#
#   bash tests/vllm/gpu_check.sh --fetch-wheels   # HERE, with pip: wheels for a CPython 3.12 x86-64
#                                                 # GPU image into build/gpu-wheels (ignored, ~6 MB)
#   bash tests/vllm/gpu_check.sh                  # THERE (carry build/gpu-wheels to a machine without network)
#   bash tests/vllm/gpu_check.sh --cpu            # the same plumbing without a GPU: runs the CPU twin
#                                                 # of the CUDA test instead (checks the environment)
#
# Environment: PYTHON (default python3), KVFERRY_GPU_WHEELS (default build/gpu-wheels),
# KVFERRY_GPU_SITE (default /tmp/kvferry-gpu-site), KVFERRY_GPU_VENV (default /tmp/kvferry-gpu-venv),
# WHEELS_PYTHON_VERSION (for --fetch-wheels, default 3.12).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
WHEELS=${KVFERRY_GPU_WHEELS:-$ROOT/build/gpu-wheels}
SITE=${KVFERRY_GPU_SITE:-/tmp/kvferry-gpu-site}
VENV=${KVFERRY_GPU_VENV:-/tmp/kvferry-gpu-venv}
# kvferry's runtime packages that a GPU image with torch, numpy, pytest, httpx, xxhash, prometheus-client
# and rich (the lent H200s' image) lacks, at the versions kvferry's own environment runs, and what they
# need at versions that image may not have. Pure Python except msgspec, pyzmq and pydantic-core.
CARRIED="msgspec==0.23.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4
pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
annotated-doc==0.0.7 uvicorn==0.55.0 anyio==4.16.0 h11==0.16.0 click==8.5.1 opentelemetry-api==1.45.2"
# Everything kvferry's connector and these tests import.
NEEDED="numpy msgspec zmq fastapi uvicorn httpx xxhash prometheus_client rich pytest pytest_timeout torch"
start=$(date +%s)

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086  # CARRIED is a list of requirements
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEELS_PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" $CARRIED
    ls -l "$WHEELS"
    echo "gpu check: wheels in $WHEELS ($(du -sh "$WHEELS" | cut -f1)); carry that folder" >&2
    exit 0
fi
CPU_ONLY=0
[ "${1:-}" = "--cpu" ] && CPU_ONLY=1

has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

if has_cuda_torch "$PY" || { [ "$CPU_ONLY" = 1 ] && "$PY" -c 'import torch' >/dev/null 2>&1; }; then
    RUN=$PY
    missing=$("$RUN" - $NEEDED <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
)
    if [ -n "$missing" ]; then
        echo "gpu check: $RUN lacks $missing: installing kvferry's runtime packages into $SITE" >&2
        rm -rf "$SITE"
        if compgen -G "$WHEELS/*.whl" >/dev/null; then
            "$RUN" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
        else
            # shellcheck disable=SC2086
            "$RUN" -m pip install -q --no-deps --target "$SITE" $CARRIED
        fi
        export PYTHONPATH=$SITE
    fi
else
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        echo "gpu check: $PY has no CUDA torch: building $VENV with torch from the package index" >&2
        rm -rf "$VENV"
        "$PY" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -q --no-cache-dir torch  # no cache: ~3 GB written for nothing
    fi
    "$VENV/bin/python" -m pip install -q numpy msgspec pyzmq fastapi uvicorn httpx xxhash prometheus-client rich \
        pytest pytest-timeout
    RUN=$VENV/bin/python
fi
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}  # kvferry from this checkout, no build step
echo "gpu check: environment ready after $(( $(date +%s) - start )) s" >&2

"$RUN" - "$CPU_ONLY" $NEEDED <<'PY'
import importlib, sys

cpu_only = sys.argv[1] == "1"
for name in sys.argv[2:]:
    importlib.import_module(name)  # a clear ImportError now rather than a confusing skip later
import torch

import kvferry.connector.scheduler  # noqa: F401  (from this checkout's src/)

if not cpu_only:
    assert torch.cuda.is_available(), (
        f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device; "
        "check nvidia-smi and that the driver supports this CUDA version"
    )
    print(f"gpu check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
else:
    print(f"gpu check: torch {torch.__version__}, --cpu: the CPU twin of the CUDA test")
PY

SELECT=cuda
[ "$CPU_ONLY" = 1 ] && SELECT="pulled_blocks and not cuda"
LOG=${TMPDIR:-/tmp}/kvferry-gpu-check.log
set +e
# -k: only the CUDA tests (or their CPU twin). A skip would mean the check did not run: a failure here.
timeout 300 "$RUN" -m pytest tests/vllm/test_vllm_layout.py -k "$SELECT" -x -p no:cacheprovider -v -rs \
    2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
if [ "$status" = 0 ] && grep -q -E "[0-9]+ skipped" "$LOG"; then
    echo "gpu check: a test was skipped; on a GPU machine that is a failure of this check" >&2
    status=1
fi
echo "gpu check: done in $(( $(date +%s) - start )) s, exit $status" >&2
exit "$status"
