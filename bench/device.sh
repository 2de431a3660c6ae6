#!/usr/bin/env bash
# bench/gpu.sh on a bare GPU machine that gets voxpipe's GPU packages carried with the tree (a tool
# that copies this tree to the machine and returns $OUT):
#
#   bash bench/device.sh STAGE [STAGE ...]
#
# VOXPIPE_WHEELS (default .whl): a folder of wheels (FlashInfer and what the machine's Python lacks;
# for the GPU test stages also pytest, pluggy and iniconfig), installed without an index into
# /tmp/site. VOXPIPE_FI_CACHE (default .devcache): FlashInfer's
# compiled kernels as fi_cache.tgz or its parts fi_cache.tgz.* (a split tar, for tools that return
# files of 16 MiB at most), restored first; when kernels were compiled meanwhile, the grown cache is
# written to $OUT as fi_cache.tgz.* (copy them back into that folder, replacing the old parts).
# A copied tree may carry another commit's .git: set VOXPIPE_COMMIT so that reports name the right one.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
WHEELS=${VOXPIPE_WHEELS:-.whl}
CACHE=${VOXPIPE_FI_CACHE:-.devcache}
mkdir -p "$OUT" ~/.cache

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    # pip dates every file now; FlashInfer's ninja build would then find its cached objects older
    # than the headers they include and compile every kernel again. Date the packages before them.
    find /tmp/site -exec touch -h -d 2001-01-01 {} + 2>/dev/null
    export PATH=$PATH:/tmp/site/bin PYTHONPATH=$PWD:/tmp/site
fi
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
if ls "$CACHE"/fi_cache.tgz.* >/dev/null 2>&1; then
    cat "$CACHE"/fi_cache.tgz.* | tar xz -C ~/.cache
elif [ -f "$CACHE/fi_cache.tgz" ]; then
    tar xzf "$CACHE/fi_cache.tgz" -C ~/.cache
fi
# The compiled kernels now: only new ones make the cache worth returning (logs and lock files change
# on every run).
find ~/.cache/flashinfer -name '*.so' 2>/dev/null | sort >/tmp/fi_restored

OUT=$OUT bash bench/gpu.sh "$@"

if ! find ~/.cache/flashinfer -name '*.so' 2>/dev/null | sort | cmp -s - /tmp/fi_restored; then
    tar cz -C ~/.cache flashinfer | split -b 15M - "$OUT/fi_cache.tgz."
    ls -la "$OUT"/fi_cache.tgz.*
else
    echo "FlashInfer cache unchanged: not returned"
fi
