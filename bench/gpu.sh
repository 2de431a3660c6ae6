#!/usr/bin/env bash
# The GPU benchmarks and the GPU test suite on your own CUDA machine, stage by stage:
#
#   bash bench/gpu.sh STAGE [STAGE ...]
#
# Needs: voxpipe installed with its GPU extras (torch with CUDA, FlashInfer; see README.md), a GPU
# with room for a dummy Orpheus-3B (bf16, ~7 GB, plus the KV cache: 40 GB is plenty; 80 GB for
# `load` at 512 streams). No checkpoint is downloaded: every stage runs dummy weights.
#
# Stages (each writes $OUT/NAME.log and its JSON to $OUT):
#   tests          python -m pytest tests/gpu (every GPU test; its reports to $OUT)
#   parity         tests/gpu/test_gpu_parity.py: logits, prefill graphs, greedy alone vs batched, codec graphs
#   invariance     tests/gpu batch and op invariance, a burst through batched prefill graphs (fp8 weights and
#                  cache, what `load` serves)
#   bf16-invariance  tests/gpu/test_gpu_op_invariance.py (every GEMM way's bits and times, the row-invariant
#                  kernel's among them), then the bf16 decode step with one cuBLAS GEMM, row tiles of 64
#                  and the row-invariant kernel (`voxpipe bench step --decode-row-tiles 0,64,invariant`)
#   xqa            tests/gpu/test_gpu_xqa_parity.py, then `voxpipe bench options` for the XQA configs
#   csm            tests/gpu/test_gpu_csm_parity.py
#   qwen3          tests/gpu/test_gpu_qwen3_tts_parity.py
#   lanes          tests/gpu/test_gpu_prompt_lane.py: the prompt lanes on the GPU
#   higgs          tests/gpu/test_gpu_higgs_tts_parity.py, tests/gpu/test_gpu_higgs_tts_clone.py
#   codec-merge    tests/gpu/test_gpu_codec_merge.py: merged codec windows (--codec-merge) against window by
#                  window, their times (serve a load with VOXPIPE_SERVE_EXTRA="--codec-merge 8" to compare)
#   codec-tails    tests/gpu/test_gpu_codec_compile_tails.py: full-context tail windows compiled
#                  (--codec-compile-tails) against graphed uncompiled, their audio and a pass's time
#   codec-leads    tests/gpu/test_gpu_codec_compile_leads.py, test_gpu_codec_lead_batch.py and
#                  test_gpu_codec_first_lane.py: lead windows (first chunks) compiled (--codec-compile-leads),
#                  in wider graphs (--codec-lead-batch) or in the first lane (--codec-first-lane) against
#                  graphed uncompiled parts of 16, their audio and a pass's time
#   chatterbox     tests/gpu/test_gpu_chatterbox_parity.py (T3 with classifier-free guidance) and
#                  tests/gpu/test_gpu_chatterbox_s3gen.py (S3Gen: the reference, stream graphs, GPU time)
#   step | speed | offline | options | profile | attention | op-invariance | codec | codec-profile
#                  `voxpipe bench STAGE` with the serving flags below
#   load | load-mps | load-adaptive   `voxpipe bench ttfa` then the load curve on the same server
#   burst          Orpheus, the settings of record (docs/performance.md): `voxpipe bench ttfa`, then
#                  closed-loop levels (VOXPIPE_LOAD, default 32..512) whose clients all start at once
#                  (`--burst`), each level from an idle server; result burst.json
#   offline-serve  Orpheus, the settings of record, as an offline batch through the whole server: VOXPIPE_LOAD
#                  (default 512) closed-loop clients started at once for VOXPIPE_LOAD_S (default 30 s), every
#                  one admitted (--max-streams) and in every step (--sit-out 0), the codec beside the LM;
#                  its x_realtime is the server's offline throughput (result offline-serve.json)
#   orpheus-rate   Orpheus, the settings of record: `voxpipe bench ttfa`, then open-loop Poisson arrivals
#                  (VOXPIPE_RATES, default 20,40,80) of 8-15-word sentences, 360 tokens each (4.4 s of
#                  audio: random weights never end a stream themselves); result orpheus-rate.json
#   csm-load       the same for CSM
#   qwen3-rate     Qwen3-TTS (VOXPIPE_QWEN3_MODEL, default the 1.7B CustomVoice) with the model's own
#                  settings (its spec's serve_defaults) and MPS: `voxpipe bench ttfa`, then open-loop
#                  Poisson arrivals (VOXPIPE_RATES) of 8-15-word sentences, 60-75 frames each (4.8-6 s of
#                  audio: random weights rarely end a stream themselves)
#   higgs-load     Higgs Audio v2 3B: `voxpipe bench ttfa`, then the load curve (VOXPIPE_LOAD), streams
#                  of 250 rows (10 s of audio; random weights never end one themselves)
#   chatterbox-load  Chatterbox: `voxpipe bench ttfa`, then the load curve (VOXPIPE_LOAD), streams of 250
#                  speech tokens (10 s of audio), S3Gen in float16 and T3 in fp8 (S3Gen bounds the
#                  streams: in float32 two are already late); give it VOXPIPE_STAGE_S=300
#   clone          voice cloning, Qwen3-TTS Base (VOXPIPE_CLONE_MODEL, default the 1.7B): `voxpipe bench ttfa`
#                  with the time to first audio of requests by a saved voice (ttfa_ms: the Base model has
#                  no preset voice), with a new 3 s clip each (clip_ttfa_ms: the clip decoded and encoded
#                  every time) and by a voice saved once (voice_ttfa_ms), into clone-ttfa.json; then
#                  closed-loop levels (VOXPIPE_LOAD, default 16,64), each twice: no stream cloning (the
#                  baseline), then a quarter of the streams sending a new clip per request, the cloned and
#                  plain requests' TTFA and on-time share apart (`cloned`, `plain`), into clone-load.json.
#                  Streams of 60-210 rows, prompt included (a 3 s clip in context is ~40 of them)
#   ws             input streaming over the WebSocket: `voxpipe bench ws --serve` starts Qwen3-TTS
#                  (VOXPIPE_QWEN3_MODEL, default the 1.7B CustomVoice) on dummy weights with qwen3-rate's
#                  flags, runs 1 and 100 sessions (VOXPIPE_WS_SESSIONS) appending a word every 10 and 33 ms,
#                  streams of 60-150 rows (random weights rarely end a stream), stops the server; ws.json
#
# Environment: OUT (default /tmp/out), VOXPIPE_STAGE_S (per-stage timeout, default 300 s),
# VOXPIPE_LOAD / VOXPIPE_LOAD_S (load levels and seconds per level), VOXPIPE_SERVE_EXTRA (more
# `voxpipe serve` flags), VOXPIPE_LM_SIZES, VOXPIPE_LM_CONFIGS, VOXPIPE_ATTN_VARIANTS / _SIZES,
# VOXPIPE_CODEC_BATCH / _OTHER, VOXPIPE_COMPILE_MODES, VOXPIPE_PROFILE_BATCH / _FLAGS,
# VOXPIPE_TAP_LEVEL / VOXPIPE_PROFILE_LEVEL / VOXPIPE_PROFILE_ROLES (load, burst and the rate
# stages: a tap, py-spy profiles of those workers, at that level; VOXPIPE_TAP_FROM_START=1: the tap
# from the level's first request; VOXPIPE_TAP_SECONDS: how long the tap records, e.g. 14 to see a
# burst level's second wave, ~9 s in with the default 1024-token streams), VOXPIPE_CLONE_MODEL,
# VOXPIPE_QWEN3_MODEL, VOXPIPE_RATES, VOXPIPE_WS_SESSIONS, VOXPIPE_LABEL (device label, default:
# nvidia-smi's), VOXPIPE_CLIENT_PROCS (the burst stage's client processes, default 4: a burst's
# requests go out side by side).
# bench/device.sh wraps this script for a bare machine that gets the packages carried with the tree.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGE_S=${VOXPIPE_STAGE_S:-300}
LABEL=${VOXPIPE_LABEL:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)}
export PYTHONUNBUFFERED=1
serve_flags="--max-batch-size 512 --lm-head audio --codec-dtype float16"
# the rest of the settings of record (docs/performance.md, "Results of record")
record_flags="--first-chunk progressive --mps on --kv-cache-dtype fp8 --quantization fp8 --codec-gpu-share 50"
bench="python -m common.cli bench"

run() {  # run NAME CMD...: timed, logged, never stops the other stages
    local name=$1
    shift
    local t0=$SECONDS
    timeout "$STAGE_S" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: rc $? in $((SECONDS - t0)) s"
    tail -n 3 "$OUT/$name.log"
}
observe() {  # observe STAGE: bench ttfa's flags for a tap and py-spy profiles of one load level
    echo ${VOXPIPE_TAP_LEVEL:+--tap-level $VOXPIPE_TAP_LEVEL --tap-out $OUT/$1-tap.jsonl.gz} \
        ${VOXPIPE_TAP_FROM_START:+--tap-from-start} ${VOXPIPE_TAP_SECONDS:+--tap-seconds $VOXPIPE_TAP_SECONDS} \
        ${VOXPIPE_PROFILE_LEVEL:+--profile-level $VOXPIPE_PROFILE_LEVEL --profile-out $OUT/$1-py-spy} \
        ${VOXPIPE_PROFILE_ROLES:+--profile-roles $VOXPIPE_PROFILE_ROLES}
}
gpu_tests() {  # gpu_tests NAME FILES...: the GPU tests, their reports to $OUT
    local name=$1
    shift
    run "$name" env VOXPIPE_GPU_REPORT_DIR="$OUT" python -m pytest -v -p no:cacheprovider "$@"
}

for stage in "$@"; do
    # shellcheck disable=SC2086
    case $stage in
    tests) gpu_tests tests tests/gpu ;;
    parity) gpu_tests parity tests/gpu/test_gpu_parity.py ;;
    invariance) gpu_tests invariance tests/gpu/test_gpu_batch_invariance.py tests/gpu/test_gpu_op_invariance.py tests/gpu/test_gpu_burst_prefill_invariance.py ;;
    csm) gpu_tests csm tests/gpu/test_gpu_csm_parity.py ;;
    qwen3) gpu_tests qwen3 tests/gpu/test_gpu_qwen3_tts_parity.py ;;
    lanes) gpu_tests lanes tests/gpu/test_gpu_prompt_lane.py ;;
    higgs) gpu_tests higgs tests/gpu/test_gpu_higgs_tts_parity.py tests/gpu/test_gpu_higgs_tts_clone.py ;;
    codec-merge) gpu_tests codec-merge tests/gpu/test_gpu_codec_merge.py ;;
    codec-tails) gpu_tests codec-tails tests/gpu/test_gpu_codec_compile_tails.py ;;
    codec-leads)
        gpu_tests codec-leads tests/gpu/test_gpu_codec_compile_leads.py tests/gpu/test_gpu_codec_lead_batch.py \
            tests/gpu/test_gpu_codec_first_lane.py
        ;;
    chatterbox) gpu_tests chatterbox tests/gpu/test_gpu_chatterbox_parity.py tests/gpu/test_gpu_chatterbox_s3gen.py ;;
    bf16-invariance)
        gpu_tests bf16-invariance tests/gpu/test_gpu_op_invariance.py
        run bf16-step $bench step --skip prefill,ttfa,offline,baseline --lm-head audio \
            --sizes "${VOXPIPE_LM_SIZES:-1,64,128,256,384,512}" --decode-row-tiles 0,64,invariant --out "$OUT/bf16-step.json"
        ;;
    xqa)
        gpu_tests xqa-parity tests/gpu/test_gpu_xqa_parity.py
        run xqa-speed $bench options --configs bf16+audio_head,audio_head+fp8kv,audio_head+fp8kv+flashinfer,audio_head+xqa \
            --sizes "${VOXPIPE_LM_SIZES:-1,64,128,256,384,512}" --out "$OUT/xqa-speed.json"
        ;;
    step | speed) run "$stage" $bench "$stage" --lm-head audio --codec-dtype float16 --out "$OUT/$stage.json" ;;
    offline)
        run offline $bench offline --lm-head audio --codec-dtype float16 --offline-requests 512 --offline-gather 256 \
            --out "$OUT/offline.json"
        ;;
    options)
        run options $bench options --configs "${VOXPIPE_LM_CONFIGS:-bf16+audio_head}" \
            --sizes "${VOXPIPE_LM_SIZES:-1,64,256,384,512}" --out "$OUT/options.json"
        ;;
    profile) run profile $bench profile --batch "${VOXPIPE_PROFILE_BATCH:-384}" --lm-head audio ${VOXPIPE_PROFILE_FLAGS:-} ;;
    attention)
        run attention $bench attention --variants "${VOXPIPE_ATTN_VARIANTS:-}" \
            --sizes "${VOXPIPE_ATTN_SIZES:-64,256,384,512}" --out "$OUT/attention.json"
        ;;
    op-invariance) run op-invariance $bench op-invariance --out "$OUT/op-invariance.json" ;;
    codec) run codec $bench codec --out "$OUT/codec.json" ;;
    codec-profile)
        run codec-profile $bench codec-profile --batch "${VOXPIPE_CODEC_BATCH:-128}" \
            --compile-modes "${VOXPIPE_COMPILE_MODES:-}" --other-batches "${VOXPIPE_CODEC_OTHER:-1,16,64,256}" \
            --out "$OUT/codec-profile.json"
        ;;
    load | load-mps | load-adaptive)
        first=progressive extra=""
        [ "$stage" = load-adaptive ] && first=adaptive
        [ "$stage" = load-mps ] && extra="--mps on"
        run "$stage" $bench ttfa --reps 15 --tokens 200 --load "${VOXPIPE_LOAD:-128,192,256,320,384}" \
            --load-duration "${VOXPIPE_LOAD_S:-20}" --ramp 8 --label "$LABEL" --load-out "$OUT/$stage.json" \
            --out "$OUT/$stage-ttfa.json" $(observe "$stage") \
            -- $serve_flags --first-chunk $first $extra ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    burst)
        run burst $bench ttfa --reps 15 --tokens 200 --load "${VOXPIPE_LOAD:-32,64,128,256,384,448,512}" \
            --load-duration "${VOXPIPE_LOAD_S:-20}" --burst --client-procs "${VOXPIPE_CLIENT_PROCS:-4}" \
            --label "$LABEL" --load-out "$OUT/burst.json" \
            --out "$OUT/burst-ttfa.json" $(observe burst) -- $serve_flags $record_flags ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    offline-serve)
        run offline-serve $bench ttfa --reps 3 --tokens 200 --load "${VOXPIPE_LOAD:-512}" \
            --load-duration "${VOXPIPE_LOAD_S:-30}" --burst --label "$LABEL" --load-out "$OUT/offline-serve.json" \
            --out "$OUT/offline-serve-ttfa.json" -- $serve_flags $record_flags --max-streams "${VOXPIPE_LOAD:-512}" \
            --sit-out 0 --queue-timeout 600 ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    orpheus-rate)
        run orpheus-rate $bench ttfa --reps 15 --tokens 200 --rate "${VOXPIPE_RATES:-20,40,80}" --texts sentences \
            --load-duration "${VOXPIPE_LOAD_S:-20}" --load-tokens 360 --label "$LABEL" \
            --load-out "$OUT/orpheus-rate.json" --out "$OUT/orpheus-rate-ttfa.json" $(observe orpheus-rate) -- $serve_flags $record_flags \
            ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    qwen3-rate)
        run qwen3-rate $bench ttfa --model "${VOXPIPE_QWEN3_MODEL:-qwen3-tts}" --reps 15 --tokens 60 \
            --rate "${VOXPIPE_RATES:-1,10,20,40,60,80}" --texts sentences --load-duration "${VOXPIPE_LOAD_S:-20}" \
            --load-tokens 60 --prompt-allowance 40 --label "$LABEL" --load-out "$OUT/qwen3-rate.json" \
            --out "$OUT/qwen3-ttfa.json" $(observe qwen3-rate) -- --max-batch-size 256 --codec-dtype float16 --mps on \
            ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    csm-load)
        run csm-load $bench ttfa --model csm --reps 5 --tokens 40 --load "${VOXPIPE_LOAD:-16,32,64,96}" \
            --load-duration 15 --load-tokens 150 --ramp 4 --label "$LABEL" --load-out "$OUT/csm-load.json" \
            --out "$OUT/csm-ttfa.json" -- --max-batch-size 128 --codec-dtype float16 ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    higgs-load)
        run higgs-load $bench ttfa --model higgs-tts --reps 10 --tokens 150 --load "${VOXPIPE_LOAD:-16,32,64,128}" \
            --load-duration 15 --load-tokens 250 --ramp 4 --label "$LABEL" --load-out "$OUT/higgs-load.json" \
            --out "$OUT/higgs-ttfa.json" -- --max-batch-size 256 ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    chatterbox-load)
        run chatterbox-load $bench ttfa --model chatterbox --reps 10 --tokens 100 --prompt-allowance 250 \
            --load "${VOXPIPE_LOAD:-4,8,12,16}" --load-duration 15 --load-tokens 250 --ramp 4 --label "$LABEL" \
            --load-out "$OUT/chatterbox-load.json" --out "$OUT/chatterbox-ttfa.json" -- --max-batch-size 64 \
            --codec-dtype float16 --quantization fp8 ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    clone)
        run clone $bench ttfa --model "${VOXPIPE_CLONE_MODEL:-qwen3-tts-base}" --reps 15 --tokens 60 --clone-reps 15 \
            --load "${VOXPIPE_LOAD:-16,64}" --clone-share 0,0.25 --texts sentences --load-duration "${VOXPIPE_LOAD_S:-20}" \
            --load-tokens 60 --prompt-allowance 150 --ramp 4 --label "$LABEL" --load-out "$OUT/clone-load.json" \
            --out "$OUT/clone-ttfa.json" -- --max-batch-size 256 --codec-dtype float16 --mps on \
            --codec-gpu-share 50 ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    ws)
        run ws $bench ws --serve "${VOXPIPE_QWEN3_MODEL:-qwen3-tts}" --sessions "${VOXPIPE_WS_SESSIONS:-1,100}" \
            --word-ms 10,33 --min-tokens 60 --max-tokens 150 --out "$OUT/ws.json" -- --max-batch-size 256 \
            --codec-dtype float16 --mps on ${VOXPIPE_SERVE_EXTRA:-}
        ;;
    *) echo "unknown stage $stage (see the head of bench/gpu.sh)" ;;
    esac
done
