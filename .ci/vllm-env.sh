#!/usr/bin/env bash
# Builds the optional vLLM test environment (lean, CPU-only: enough for vLLM's scheduler, not for
# running a model) and installs this checkout into it, editable. Reuses an environment that already
# exists and imports fine; idempotent. Prints the environment's path on its last line.
#
# vLLM 0.33.0's wheel pins torch==2.14.0 (a CUDA build, ~9.5 GB with everything). The scheduler needs
# neither CUDA nor vllm._C, so: the cached CPU torch 2.13.0, then vLLM and xgrammar without their
# dependencies, then the small packages vLLM's scheduler path imports. pip warns about the torch pin and
# missing GPU packages and still exits 0 (do not run `pip check` here); `import vllm` warns that
# vllm._C failed to load, which the scheduler never needs.
#
#   bash .ci/vllm-env.sh                      # env in ./.venv-vllm
#   KVFERRY_VLLM_VENV=DIR bash .ci/vllm-env.sh  # env elsewhere (e.g. outside a CI clone, to reuse it)
#   KVFERRY_VLLM_ENV_REBUILD=1 ...            # throw the env away and build it anew
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${KVFERRY_VLLM_VENV:-$ROOT/.venv-vllm}
PY=${PYTHON:-python3}
VLLM_VERSION=0.33.0
STAMP="$VENV/.kvferry-vllm-env"
# Bump when the recipe below changes, so environments built by an older recipe are rebuilt.
RECIPE="v1 vllm==$VLLM_VERSION torch==2.13.0 xgrammar==0.2.8"

check() {  # 0: vLLM's scheduler and this checkout's connector import; 3: vLLM fine, kvferry elsewhere
    [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] || return 1
    "$VENV/bin/python" - "$VLLM_VERSION" "$ROOT/src" <<'PY' >>"$VENV/check.log" 2>&1
import sys
import pytest, torch, vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
assert vllm.__version__ == sys.argv[1], vllm.__version__
try:
    import kvferry.integrations.vllm as m
except Exception:  # a broken checkout is not a broken env: never rebuild for it
    sys.exit(3)
sys.exit(0 if m.__file__.startswith(sys.argv[2]) else 3)
PY
}

pip_install() {
    # pip's expected warnings (the torch pin, missing GPU packages) go to the log, not the console.
    if ! "$VENV/bin/python" -m pip install -q "$@" >>"$VENV/build.log" 2>&1; then
        tail -40 "$VENV/build.log" >&2
        echo "vllm env: pip install $* failed (full log: $VENV/build.log)" >&2
        exit 1
    fi
}

status=1
if [ -z "${KVFERRY_VLLM_ENV_REBUILD:-}" ]; then
    check && status=0 || status=$?
fi
if [ "$status" != 1 ]; then
    echo "vllm env: reusing $VENV" >&2
else
    start=$(date +%s)
    echo "vllm env: building $VENV (lean CPU recipe, about 2 minutes)" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    pip_install --upgrade pip
    pip_install torch==2.13.0  # the CPU wheel cached on these machines
    pip_install --no-deps "vllm==$VLLM_VERSION" xgrammar==0.2.8
    pip_install packaging 'pydantic>=2.12' regex numpy psutil cbor2 pyzmq requests \
        'transformers>=5.16.1,<5.21' aiohttp oss-harmony openai pillow pybase64 cachetools msgspec \
        cloudpickle uvloop py-cpuinfo prometheus_client 'fastapi<0.137' partial-json-parser \
        'llguidance<1.8' 'apache-tvm-ffi==0.1.11' einops
    pip_install -e "$ROOT[test]"
    echo "$RECIPE" >"$STAMP"
    check && status=0 || status=$?
    echo "vllm env: built in $(( $(date +%s) - start )) s" >&2
fi
if [ "$status" = 3 ]; then
    # Another checkout (a CI clone, say) installed kvferry here: point the env at this one.
    pip_install -e "$ROOT[test]"
    check && status=0 || status=$?
fi
if [ "$status" != 0 ]; then
    rm -f "$STAMP"
    tail -20 "$VENV/check.log" >&2 || true
    echo "vllm env: $VENV does not import vLLM's scheduler and this checkout's kvferry.integrations.vllm" >&2
    exit 1
fi
# The NIXL data plane (`"transfer": "nixl"`, tests/vllm/test_vllm_nixl_frozen_p.py): an add-on with its
# own stamp, so adding it never rebuilds the env. Both without their dependencies: the NIXL agent and UCX
# need only numpy (UCX moves host memory over cma/tcp; no CUDA library loads without a GPU), and nixl-cu12's
# torch requirement would pull a CUDA torch.
NIXL="nixl-cu12==1.5.1 nixl==1.5.1"
if [ "$(cat "$VENV/.kvferry-vllm-nixl" 2>/dev/null)" != "$NIXL" ] \
    || ! "$VENV/bin/python" -c 'import nixl._api' >>"$VENV/check.log" 2>&1; then
    pip_install --no-deps $NIXL
    "$VENV/bin/python" -c 'import nixl._api' >>"$VENV/check.log" 2>&1 \
        || { tail -20 "$VENV/check.log" >&2; echo "vllm env: nixl does not import" >&2; exit 1; }
    echo "$NIXL" >"$VENV/.kvferry-vllm-nixl"
fi
echo "$VENV"
