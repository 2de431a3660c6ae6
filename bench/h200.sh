#!/usr/bin/env bash
# The H200 runs of bench/, for the device tool (which copies this tree and returns $OUT):
#
#   bash bench/h200.sh STAGE [STAGE ...]     (carry .whl and .devcache; see ../shared/device/README.md)
#
# Stages: parity, invariance, op-invariance, codec-passes, speed, offline, lm-options, load, load-mps, load-adaptive, csm,
# csm-load, attention, xqa, codec-profile, fp8-gemm, profile.
# Every stage writes its JSON and log to $OUT and has its own timeout (VOXPIPE_STAGE_S, default 300 s).
# The FlashInfer kernel cache travels in .devcache/fi_cache.tgz.* (a split tar: the device returns
# files of 16 MiB at most); this script restores it first and saves it to $OUT last when kernels were
# compiled meanwhile. Copy returned fi_cache.tgz.* back into .devcache/ (replacing the old parts).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGE_S=${VOXPIPE_STAGE_S:-300}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
# pip writes every file with the install time. FlashInfer's ninja build compares its cached objects
# with the headers they include, so fresh headers would make it compile every kernel again (193 s
# for the prefill kernels, seen on the H200). Date the installed packages before any cached object.
find /tmp/site -exec touch -h -d 2001-01-01 {} + 2>/dev/null
export PATH=$PATH:/tmp/site/bin PYTHONPATH=$PWD:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
mkdir -p ~/.cache
if ls .devcache/fi_cache.tgz.* >/dev/null 2>&1; then
    cat .devcache/fi_cache.tgz.* | tar xz -C ~/.cache
elif [ -f .devcache/fi_cache.tgz ]; then
    tar xzf .devcache/fi_cache.tgz -C ~/.cache
fi

# The compiled kernels there now: only new ones make the cache worth returning (logs and lock files
# change on every run, so a plain "anything newer" returned it every time).
find ~/.cache/flashinfer -name '*.so' 2>/dev/null | sort >/tmp/fi_restored
serve_flags="--max-batch-size 512 --lm-head audio --codec-dtype float16"
run() {  # run NAME CMD...: timed, logged, never stops the other stages
    local name=$1
    shift
    local t0=$SECONDS
    timeout "$STAGE_S" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: rc $? in $((SECONDS - t0)) s"
    tail -n 3 "$OUT/$name.log"
}

for stage in "$@"; do
    case $stage in
    parity) run parity python -m bench.gpu_parity --out "$OUT/parity.json" ;;
    invariance)  # bf16 weights (both caches), then what the load stages serve: fp8 weights and cache
        run invariance python -m bench.batch_invariance --kv-cache-dtypes auto,fp8 --temperatures 0,0.6 --out "$OUT/invariance.json"
        run invariance-fp8 python -m bench.batch_invariance --quantization fp8 --lm-head audio --kv-cache-dtypes fp8 \
            --temperatures 0,0.6 --out "$OUT/invariance-fp8.json"
        ;;
    op-invariance) run op-invariance python -m bench.op_invariance --out "$OUT/op-invariance.json" ;;
    codec-passes) run codec-passes python -m bench.codec_passes --out "$OUT/codec-passes.json" ;;
    speed) run speed python -m bench.gpu_speed --lm-head audio --codec-dtype float16 --out "$OUT/speed.json" ;;
    offline)
        run offline python -m bench.gpu_speed --skip steps,prefill,ttfa,baseline --lm-head audio \
            --codec-dtype float16 --offline-requests 512 --offline-gather 256 --out "$OUT/offline.json"
        ;;
    lm-options)
        run lm-options python -m bench.lm_options --configs "${VOXPIPE_LM_CONFIGS:-bf16+audio_head}" \
            --sizes "${VOXPIPE_LM_SIZES:-1,64,256,384,512}" --out "$OUT/lm-options.json"
        ;;
    load | load-mps | load-adaptive)
        first=progressive extra=""
        [ "$stage" = load-adaptive ] && first=adaptive
        [ "$stage" = load-mps ] && extra="--mps on"
        # shellcheck disable=SC2086
        run "$stage" python -m bench.ttfa_http --reps 15 --tokens 200 --load "${VOXPIPE_LOAD:-128,192,256,320,384}" \
            --load-duration "${VOXPIPE_LOAD_S:-20}" --ramp 8 --label "NVIDIA H200" --load-out "$OUT/$stage.json" \
            --out "$OUT/$stage-ttfa.json" ${VOXPIPE_TAP_LEVEL:+--tap-level $VOXPIPE_TAP_LEVEL --tap-out $OUT/$stage-tap.jsonl.gz} \
            ${VOXPIPE_PROFILE_LEVEL:+--profile-level $VOXPIPE_PROFILE_LEVEL --profile-out $OUT/$stage-py-spy} \
            -- $serve_flags --first-chunk $first $extra ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    csm) run csm python bench/csm_gpu_parity.py --out "$OUT/csm.json" ;;
    csm-load)
        run csm-load python -m bench.ttfa_http --model csm --reps 5 --tokens 40 --load "${VOXPIPE_LOAD:-16,32,64,96}" \
            --load-duration 15 --load-tokens 150 --ramp 4 --label "NVIDIA H200" --load-out "$OUT/csm-load.json" \
            --out "$OUT/csm-ttfa.json" -- --max-batch-size 128 --codec-dtype float16
        ;;
    xqa)  # decode attention on XQA: fidelity, then the engine step against bf16 FlashInfer
        run xqa-parity python -m bench.xqa_parity --out "$OUT/xqa-parity.json"
        run xqa-speed python -m bench.lm_options \
            --configs bf16+audio_head,audio_head+fp8kv,audio_head+fp8kv+flashinfer,audio_head+xqa \
            --sizes "${VOXPIPE_LM_SIZES:-1,64,128,256,384,512}" --out "$OUT/xqa-speed.json"
        ;;
    attention)
        run attention python -m bench.attention_kv --variants "${VOXPIPE_ATTN_VARIANTS:-}" \
            --sizes "${VOXPIPE_ATTN_SIZES:-64,256,384,512}" --out "$OUT/attention.json"
        ;;
    codec-profile)
        run codec-profile python -m bench.codec_profile --batch "${VOXPIPE_CODEC_BATCH:-128}" \
            --compile-modes "${VOXPIPE_COMPILE_MODES:-}" --other-batches "${VOXPIPE_CODEC_OTHER:-1,16,64,256}" --out "$OUT/codec-profile.json"
        ;;
    fp8-gemm) run fp8-gemm python -m bench.fp8_gemm --out "$OUT/fp8-gemm.json" ;;
    profile) run profile python -m bench.profile_step --batch "${VOXPIPE_PROFILE_BATCH:-384}" --lm-head audio ${VOXPIPE_PROFILE_FLAGS:-} ;;
    *) echo "unknown stage $stage" ;;
    esac
done
# Only a cache that grew goes back: the device returns 8 files at most, and results come first.
if ! find ~/.cache/flashinfer -name '*.so' 2>/dev/null | sort | cmp -s - /tmp/fi_restored; then
    tar cz -C ~/.cache flashinfer | split -b 15M - "$OUT/fi_cache.tgz."
    ls -la "$OUT"/fi_cache.tgz.*
else
    echo "FlashInfer cache unchanged: not returned"
fi
