#!/usr/bin/env bash
# One device call that checks and times what the TPU issues need, logs under $OUT.
#
# Here, before the call (builds the wheel, tpu-inference's wheel and the shape-only model dirs):
#   rm -rf build && bash ../shared/tpu/build_carry.sh --rpa
#   python ../shared/tpu/mkshapes.py "$DEFAULT_MODEL_DIR" .tpu_carry/shapes
#   python benchmarks/moe_shape.py "$DEFAULT_MODEL_DIR" .tpu_carry/shapes/qwen3-moe-30b-a3b-4l   # e2e-qmoe
#   python benchmarks/gpt_oss_shape.py "$DEFAULT_MODEL_DIR" .tpu_carry/shapes/gpt-oss-20b-24l --layers 24  # e2e-gptoss
#   (and --layers N into gpt-oss-20b-Nl for GPTOSS_LAYERS=N)
#   (DEFAULT_MODEL_DIR: python -c "from tpuserve.tpu_platform.loader.export import default_model_hf_dir as d; print(d())")
#   git rev-parse HEAD > .tpu_carry/REV     # named in the logs
# The call (device tool, carry [".whl-tpu", ".tpu_carry"]):
#   bash benchmarks/tpu_session.sh                       # every stage, within one call's 10 minutes
#   STAGES="e2e-1b ab-256" bash benchmarks/tpu_session.sh
#   STAGES=rpa bash benchmarks/tpu_session.sh            # then STAGES=rpa64 in a second call
# Everything under $OUT comes back as session_all.tgz (PACK=0: loose files).
# Stages run in the order given; each has its own time limit and is skipped when the call's
# remaining time (BUDGET_S, default 540 s from the start) cannot hold it.
set -uo pipefail
start=$(date +%s)
budget=${BUDGET_S:-540}
stages=${STAGES:-"kernels e2e-1b ab-256 e2e-135m movers"}
out=${OUT:-/tmp/tpu_session}
mkdir -p "$out" /tmp/m
# sourced here, not in a pipe: a pipe would run it in a subshell and lose its exports
source .whl-tpu/on_tpu_setup.sh > "$out/setup.log" 2>&1
cat "$out/setup.log"
git_rev=$(cat .tpu_carry/REV 2>/dev/null || echo unknown)
echo "rev $git_rev, stages: $stages" | tee "$out/session.log"

left() { echo $(( budget - ($(date +%s) - start) )); }

checkpoint() {  # random weights for a carried shape dir, once per call
  [ -d "/tmp/m/$1" ] || python benchmarks/random_checkpoint.py --like ".tpu_carry/shapes/$1" \
      --out "/tmp/m/$1" > /dev/null
}

stage() {  # stage NAME LIMIT_S COMMAND...: run with a limit when the remaining time allows it
  local name=$1 limit=$2; shift 2
  if [ "$(left)" -lt "$limit" ]; then
    echo "skip $name: $(left) s left, needs $limit" | tee -a "$out/session.log"
    return 0
  fi
  local t0=$(date +%s)
  timeout "$limit" "$@" 2>&1 | grep -v "Warning\|warnings.warn" > "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/session.log"
  tail -n 25 "$out/$name.log"
}

for s in $stages; do
  case $s in
    kernels)   # the Pallas kernels compiled by Mosaic against jax's reference on the chip
      stage kernels 240 python benchmarks/attention_tpu.py --checks-only --rpa-v3 off --out "$out/kernels.json" ;;
    rpa|rpa64) # tpu-inference's RPA v3 (needs build_carry.sh --rpa) beside ours and jax's kernel: checked
               # against the oracle (bf16, no window / cap / sinks), then timed on every decode shape;
               # rpa at head_dim 128, rpa64 at head_dim 64 (prefill and mixed: rpa-mixed). 2026-12-05:
               # the checks and decode points of rpa ran past 420 s by the last two b128 points
      d=128; [ "$s" = rpa64 ] && d=64
      stage "$s" 420 python benchmarks/attention_tpu.py --rpa-v3 require --head-dim "$d" \
          --check-dtypes bfloat16 --check-options plain --steps decode --out "$out/${s}.json" ;;
    rpa-mixed) # the same peers on the prefill and mixed steps (the rpa stage's decode points took
               # its whole 420 s on 2026-12-05), checks first as in rpa
      stage rpa-mixed 300 python benchmarks/attention_tpu.py --rpa-v3 require --head-dim 128 \
          --check-dtypes bfloat16 --check-options plain --steps prefill,mixed --out "$out/rpa_mixed.json" ;;
    e2e-1b)
      checkpoint llama-1b-gqa
      stage e2e-1b 200 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
          --out "$out/e2e_1b.json" ;;
    ab-256)    # prefill at the CPU's scheduler sizes, against the TPU defaults of e2e-1b
      checkpoint llama-1b-gqa
      stage ab-256 80 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
          --batches "" --engine-args '{"max_num_batched_tokens": 256, "max_num_seqs": 32}' \
          --out "$out/e2e_1b_t256.json" ;;
    trace-1b)  # the 1B shape's b1 and b128 decode with a device trace of one round each: is the
               # device busy through a b128 step (device-bound) or idle between steps (host-bound)?
      checkpoint llama-1b-gqa
      stage trace-1b 200 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
          --batches 1,128 --prefill "" --device-trace "$out/trace_1b" --out "$out/trace_1b.json"
      # the summaries are in the JSON; keep the raw traces only while small
      du -sm "$out"/trace_1b_b* 2>/dev/null
      find "$out" -path "*trace_1b_b*" -name "*.xplane.pb" -size +8M -delete ;;
    e2e-135m)
      checkpoint smollm2-135m
      stage e2e-135m 140 python benchmarks/tpu_e2e.py --models /tmp/m/smollm2-135m --rounds 1 \
          --out "$out/e2e_135m.json" ;;
    movers)    # the planned-max 1B cache: the step and both page movers in place
      stage movers 130 python benchmarks/tpu_memory.py --models llama-1b --pages 0 --loops scan \
          --tokens 1 --iters 10 --movers 64 --out "$out/movers_1b.json" ;;
    host-ab)   # the host's share of a 135M decode step: the previous wheel (.whl-tpu/old/) against
               # this one in the same call, then this one sampling (temperature 1) with host profiles
      checkpoint smollm2-135m
      if ls .whl-tpu/old/*.whl > /dev/null 2>&1; then
        PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-index \
          --target /tmp/tps_old .whl-tpu/old/*.whl > /dev/null 2>&1
        stage host-old 100 env PYTHONPATH="/tmp/tps_old:$PYTHONPATH" python benchmarks/tpu_e2e.py \
            --models /tmp/m/smollm2-135m --rounds 1 --prefill "" --out "$out/host_old_135m.json"
      fi
      stage host-new 110 python benchmarks/tpu_e2e.py --models /tmp/m/smollm2-135m --rounds 1 \
          --prefill "" --host-profile "$out/host_new_135m" --out "$out/host_new_135m.json"
      stage host-t1 100 python benchmarks/tpu_e2e.py --models /tmp/m/smollm2-135m --rounds 1 \
          --prefill "" --batches 1,128 --temperature 1.0 --host-profile "$out/host_t1_135m" \
          --out "$out/host_t1_135m.json" ;;
    host-1b)   # the host's share of the 1B shape's b32 / b128 decode steps now: TPOT against the
               # device's empty step, and a cProfile of one b128 round (no warm-up: the untimed
               # round compiles what the timed one runs)
      checkpoint llama-1b-gqa
      stage host-1b "${HOST1B_LIMIT_S:-150}" python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
          --batches 32,128 --prefill "" --engine-args '{"warmup": false}' --host-profile "$out/host_1b" \
          --out "$out/host_1b.json" ;;
    moe-gmm)   # the MoE grouped matmul compiled by Mosaic: ours (bf16, int8, MXFP4) against megablox gmm and ragged_dot
      # GMM_FP4_DECODES=f32,swar: the MXFP4 experts with each decode (the second one not yet timed)
      stage moe-gmm 260 python benchmarks/moe_gmm_tpu.py --int8 --mxfp4 --fp4-decode "${GMM_FP4_DECODES:-f32}" \
          --out "$out/moe_gmm.json" ;;
    e2e-qmoe)  # a Qwen3-30B-A3B layer (128 experts, top-8) x 4 layers: MoE decode against the roofline
      [ -d /tmp/m/qwen3-moe-30b-a3b-4l ] || python benchmarks/random_checkpoint.py --dtype float16 \
          --like .tpu_carry/shapes/qwen3-moe-30b-a3b-4l --out /tmp/m/qwen3-moe-30b-a3b-4l > /dev/null
      stage e2e-qmoe 330 python benchmarks/tpu_e2e.py --models /tmp/m/qwen3-moe-30b-a3b-4l --rounds 1 \
          --out "$out/e2e_qmoe.json" ;;
    e2e-gptoss)  # gpt-oss-20b's shape, MXFP4 experts packed (GPTOSS_LAYERS of its 24, default all):
                 # does it fit one v5e with a KV cache, and batch-1 decode against the roofline of
                 # the bytes a step reads (the routed experts only). The ~12 GB random checkpoint is
                 # written here first (random_checkpoint.py: its log says how long that took).
      gpt_oss=gpt-oss-20b-${GPTOSS_LAYERS:-24}l
      [ -d "/tmp/m/$gpt_oss" ] || python benchmarks/random_checkpoint.py --dtype float16 \
          --like ".tpu_carry/shapes/$gpt_oss" --out "/tmp/m/$gpt_oss" 2>&1 | tee "$out/checkpoint_$gpt_oss.log"
      # no warm-up (as e2e-8b-fp8): the untimed round compiles only what the timed one runs; batch 1
      # only by default (what the issue asks; its 24 unrolled layers compile slowly), GPTOSS_BATCHES=1,8,32
      # GPTOSS_PREFILL=1x512 for more. 12.8 GiB of weights leave ~1.3 GiB of a v5e's 15.75 for the
      # cache and the step: the flags a 16 GB user passes (the default 131k max_model_len alone
      # needs more cache than that: the engine refuses it by name)
      JAX_LOG_COMPILES=${GPTOSS_LOG_COMPILES:-0} stage e2e-gptoss "${GPTOSS_LIMIT_S:-420}" python benchmarks/tpu_e2e.py --models "/tmp/m/$gpt_oss" \
          --rounds 1 --batches "${GPTOSS_BATCHES:-1}" --prefill "${GPTOSS_PREFILL:-}" --util 0.95 \
          --engine-args '{"warmup": false, "max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 8192}' \
          --out "$out/e2e_$gpt_oss.json" ;;
    startup)   # where the 1B shape's start-up goes: LLM() cold (empty compilation cache), then warm;
               # each run's start-up phases (read, transforms, stack, to device, tokenizer, memory
               # plan, warm-up: tpu_platform/startup_timing.py) in the log and the JSON's "phases"
      checkpoint llama-1b-gqa
      stage startup 300 python benchmarks/startup.py --model /tmp/m/llama-1b-gqa --what llm \
          --runs cold,warm --cache-dir /tmp/xla-startup --json "$out/startup_1b.json" ;;
    startup-serve) # issue 35 as a server sees it, on a bf16 checkpoint (what real 1B models ship):
               # the engine cold then warm, first answer (serving starts after the first programs)
               # and ready (every program), with the phases; then LLM() warm (offline: all programs)
      [ -d /tmp/m/llama-1b-bf16 ] || python benchmarks/random_checkpoint.py --dtype bfloat16 \
          --like .tpu_carry/shapes/llama-1b-gqa --out /tmp/m/llama-1b-bf16 > /dev/null
      stage startup-serve 300 python benchmarks/startup.py --model /tmp/m/llama-1b-bf16 --what engine \
          --runs cold,warm --cache-dir /tmp/xla-serve --json "$out/startup_serve_1b.json"
      stage startup-llm 100 python benchmarks/startup.py --model /tmp/m/llama-1b-bf16 --what llm \
          --runs warm --cache-dir /tmp/xla-serve --json "$out/startup_llm_1b.json" ;;
    backend-init) # the engine's "devices" phase (8.6 s on 2026-12-06): jax.devices() alone, with
               # JAX_PLATFORMS=tpu, with TPU_SKIP_MDS_QUERY=1, beside a transformers import, and
               # with libtpu's log (stderr files under $OUT)
      stage backend-init 120 python benchmarks/backend_init.py --runs 1 --log-dir "$out" \
          --variants "${BACKEND_VARIANTS:-default,platforms,skip-mds,overlap,verbose}" \
          --json "$out/backend_init.json" ;;
    startup-premap) # after startup-serve: the warm engine again with a smaller premapped host buffer
      for size in ${PREMAP_SIZES:-268435456}; do
        TPU_PREMAPPED_BUFFER_SIZE=$size stage "startup-premap-$size" 100 python benchmarks/startup.py \
            --model /tmp/m/llama-1b-bf16 --what engine --runs warm --cache-dir /tmp/xla-serve \
            --json "$out/startup_premap_$size.json"
      done ;;
    premap-ab) # decode speed with libtpu's default premapped host buffer and with a 256 MiB one
      checkpoint smollm2-135m
      for size in default 268435456; do
        env $( [ $size = default ] || echo TPU_PREMAPPED_BUFFER_SIZE=$size ) timeout 150 python benchmarks/tpu_e2e.py \
            --models /tmp/m/smollm2-135m --rounds 2 --batches 1,32,128 --prefill "" \
            --out "$out/premap_$size.json" 2>&1 | grep -v Warning > "$out/premap_$size.log"
        echo "premap $size:"; tail -n 12 "$out/premap_$size.log"
      done ;;
    rpa-1b)    # ours against RPA v3 at the 1B shape's heads (32 q / 8 KV, head_dim 64) with the
               # engine's cache layout, decode only, short contexts (the 1B b128 step runs ~192)
      # (195 s on 2026-12-06 before the whole-block compute was timed beside ours too)
      stage rpa-1b "${RPA1B_LIMIT_S:-280}" python benchmarks/attention_tpu.py --rpa-v3 require --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --check-dtypes bfloat16 --check-options plain,one_item --steps decode \
          --batches 32,128 --contexts 192,1024 --out "$out/rpa_1b.json" ;;
    kernels-fp8) # the FP8 KV cache in the compiled kernel at the 1B shape (32 q / 8 KV heads, d 64):
               # checked on the chip (bf16 and fp8, plain and window + cap; the fp8 write byte-exact),
               # then decode / prefill / mixed timed with a bf16 and an fp8 cache side by side
      stage kernels-fp8 330 python benchmarks/attention_tpu.py --rpa-v3 off --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --kv-dtype bfloat16,fp8 --check-dtypes bfloat16,fp8 \
          --check-options plain,window_cap --batches 1,32,128 --contexts 1024,4096,16384 \
          --out "$out/kernels_fp8.json" ;;
    attn)      # one short attention stage: ours (bf16 and the FP8 cache) and RPA v3 checked on the
               # chip (plain; mixed / decode / prefill at d 128 and d 64), then batched decode points
               # where RPA v3 led on 2026-12-05 (b32 / b128 x 1k / 4k), ours bf16 and fp8 beside it
      stage attn "${ATTN_LIMIT_S:-240}" python benchmarks/attention_tpu.py --rpa-v3 require --head-dim 128 \
          --check-dtypes bfloat16,fp8 --check-options plain --kv-dtype bfloat16,fp8 --steps decode \
          --batches 32,128 --contexts 1024,4096 --out "$out/attn.json" ;;
    kv8-quick) # the FP8 KV cache in the compiled kernel, short: checked on the chip at the 1B shape
               # (plain; decode, mixed, prefill), then one decode point per dtype
      stage kv8-quick "${KV8_LIMIT_S:-150}" python benchmarks/attention_tpu.py --rpa-v3 off --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --kv-dtype bfloat16,fp8 --check-dtypes fp8 --check-options plain \
          --steps decode --batches 32 --contexts 4096 --out "$out/kv8_quick.json" ;;
    kv8-one-item) # the one-item decode path on an FP8 cache, compiled: checked on the chip, then timed
               # against the general path (v5e turns it on for 16-bit caches only until this runs)
      stage kv8-one-item "${KV8_LIMIT_S:-150}" python benchmarks/attention_tpu.py --rpa-v3 off --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --kv-dtype fp8 --check-dtypes fp8 --check-options one_item \
          --steps decode --batches 32,128 --contexts 192,1024 --out "$out/kv8_one_item.json" ;;
    fp8-kv)    # an FP8 KV cache through LLM(...) at 0.9: warm-up, generation, peak HBM, and whether
               # its step program copies the cache. "auto" runs it on the compiled kernel (uint8
               # storage, decoded in VMEM); before, a TPU refused it (the reference's step needed
               # 56.8 GB here with the cache stored as fp8)
      checkpoint llama-1b-gqa
      stage fp8-kv 240 python benchmarks/tpu_memory.py --llm /tmp/m/llama-1b-gqa --kv-cache-dtype fp8 \
          --batches 1,128 --out "$out/fp8kv_1b.json" ;;
    quant)     # the FP8 / MXFP4 / NVFP4 matmul kernels compiled by Mosaic (checked on the chip) and a
               # layer scan of the 1B and 8B shapes' matmuls: records sliced vs whole vs XLA, against
               # bf16 and the weight-bytes roofline (8 of the 8B shape's 32 layers: memory)
      stage quant-1b 170 python benchmarks/quant_tpu.py --shape llama-1b --rows 1,8,128 --out "$out/quant_1b.json"
      stage quant-8b 150 python benchmarks/quant_tpu.py --shape llama-8b --layers 8 --rows 1,8 \
          --out "$out/quant_8b.json" ;;
    fp4)       # the FP4 kernels' weight decodes side by side (pallas_tpu_matmul.FP4_DECODES): each
               # checked against the reference on the chip, then the 1B shape's whole-record layer
               # scan at M 1 and 8 against bf16 and the roofline of the quantized bytes. Estimate
               # ~150 s (18 scans, 8 x 4 small kernels checked; not yet measured): a 240 s limit.
               # FP4_BLOCK_N=0,1024: each decode at the default N tiles and at up to 1024 too
      stage fp4 240 python benchmarks/quant_tpu.py --shape llama-1b --rows 1,8 --formats mxfp4,nvfp4 \
          --fp4-decode "${FP4_DECODES:-f32,int,swar,swar_bcast}" --fp4-block-n "${FP4_BLOCK_N:-0}" \
          --out "$out/fp4_decode_1b.json" ;;
    fp4-tiles) # the FP4 kernels' N tiles (fp4_n_tile: up to 1024 for decode row tiles since
               # 2026-12-07, 512 before) at 512 / 1024 / 2048, SWAR decode, the 1B shape at M 1/8/128 and 8
               # of the 8B shape's layers (MXFP4) at M 1/8, each checked on the chip
      stage fp4-tiles-1b 150 python benchmarks/quant_tpu.py --shape llama-1b --rows 1,8,128 --formats mxfp4,nvfp4 \
          --fp4-decode swar --fp4-block-n 512,1024,2048 --out "$out/fp4_tiles_1b.json"
      stage fp4-tiles-8b 150 python benchmarks/quant_tpu.py --shape llama-8b --layers 8 --rows 1,8 \
          --formats mxfp4 --fp4-decode swar --fp4-block-n 512,1024,2048 --out "$out/fp4_tiles_8b.json" ;;
    fp4-tiled) # FP4 records in the tiled K order (fp4.tile_k_order: x enters the kernel without the
               # SWAR column permutation, 4 XLA ops a layer, ~14 us at the 8B shape's b1 on
               # 2026-12-07) against the plain SWAR decode: checked on the chip, then timed
      stage fp4-tiled-1b 150 python benchmarks/quant_tpu.py --shape llama-1b --rows 1,8,128 --formats mxfp4,nvfp4 \
          --fp4-decode swar,swar_tiled --out "$out/fp4_tiled_1b.json"
      stage fp4-tiled-8b 150 python benchmarks/quant_tpu.py --shape llama-8b --layers 8 --rows 1,8 \
          --formats mxfp4 --fp4-decode swar,swar_tiled --out "$out/fp4_tiled_8b.json" ;;
    single-item) # the attention kernel's one-item decode path (BlockSizes.single_item_decode) off
               # and on: the 1B shape's decode at b1/b32/b128 (pages 16 tokens, 256-token rows: one
               # KV block), as two engines through LLM(...)
      checkpoint llama-1b-gqa
      for on in false true; do
        stage "single-item-$on" 170 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
            --batches 1,32,128 --prefill "" --block-sizes "{\"single_item_decode\": $on}" \
            --out "$out/single_item_$on.json"
      done ;;
    e2e-8b-fp8) # the Llama-8B shape as a pre-quantized FP8 checkpoint (bf16 would not fit 16 GB): fit,
               # ready, decode at b1/b8 against the roofline of its quantized bytes
      [ -d /tmp/m/llama-8b-fp8 ] || python benchmarks/random_checkpoint.py --quantize fp8 --dtype float16 \
          --like .tpu_carry/shapes/llama-8b-gqa --out /tmp/m/llama-8b-fp8 > /dev/null
      # no warm-up: the untimed round compiles only what the timed one runs (the 8B's 101 warm-up
      # compiles would take most of a call)
      stage e2e-8b-fp8 "${E2E8B_LIMIT_S:-330}" python benchmarks/tpu_e2e.py --models /tmp/m/llama-8b-fp8 \
          --rounds 1 --batches 1,8 --prefill "" --engine-args '{"warmup": false}' --out "$out/e2e_8b_fp8.json" ;;
    e2e-8b-mxfp4) # the Llama-8B shape as a pre-quantized MXFP4 checkpoint (compressed-tensors
               # mxfp4-pack-quantized, random bytes): issue 30's "MXFP4 at >= 50% of the roofline of
               # its quantized bytes" at batch 1
      # (the checkpoint, ~50 s, is written inside the stage: its time counts against the stage's limit)
      stage e2e-8b-mxfp4 "${E2E8B_LIMIT_S:-330}" bash -c '[ -d /tmp/m/llama-8b-mxfp4 ] ||
          python benchmarks/random_checkpoint.py --quantize mxfp4 --dtype float16 \
              --like .tpu_carry/shapes/llama-8b-gqa --out /tmp/m/llama-8b-mxfp4 > /dev/null &&
          python benchmarks/tpu_e2e.py --models /tmp/m/llama-8b-mxfp4 --rounds 1 --batches 1,8 --prefill "" \
              --engine-args "{\"warmup\": false}" --out "$0/e2e_8b_mxfp4.json"' "$out" ;;
    trace-8b-mxfp4) # the 8B MXFP4 shape's b1 decode with a device trace of one round: what the
               # step spends beside the four matmul kernels (2026-12-07: 10.17 ms a step, the
               # kernels alone ~9.26 ms by quant_tpu's 8-layer scan)
      stage trace-8b-mxfp4 200 bash -c '[ -d /tmp/m/llama-8b-mxfp4 ] ||
          python benchmarks/random_checkpoint.py --quantize mxfp4 --dtype float16 \
              --like .tpu_carry/shapes/llama-8b-gqa --out /tmp/m/llama-8b-mxfp4 > /dev/null &&
          python benchmarks/tpu_e2e.py --models /tmp/m/llama-8b-mxfp4 --rounds 1 --batches 1 --prefill "" \
              --engine-args "{\"warmup\": false}" --device-trace "$0/trace_8b_mxfp4" --out "$0/trace_8b_mxfp4.json"' "$out"
      find "$out" -name "*.xplane.pb" -size +8M -delete ;;
    hlo-1b-mxfp4) # the 1B shape in MXFP4 at b1: a device trace of one round (ops by time) and the
               # optimized HLO of its step programs, to name the XLA ops around the FP4 kernels
      checkpoint llama-1b-gqa
      rm -rf /tmp/xdump-hlo
      XLA_FLAGS="--xla_dump_to=/tmp/xdump-hlo --xla_dump_hlo_module_re=.*_step.*" stage hlo-1b-mxfp4 150 \
          python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 --batches 1 --prefill "" \
          --quantization mxfp4 --engine-args '{"quantization_calibration": "rtn", "warmup": false}' \
          --device-trace /tmp/trace-hlo --out "$out/hlo_1b_mxfp4.json"
      mkdir -p "$out/hlo" && cp /tmp/xdump-hlo/*after_optimizations.txt "$out/hlo/" ;;
    e2e-quant) # the 1B shape through LLM(...) with each online quantization, round-to-nearest (GPTQ's
               # calibration costs start-up, not step time), decode only
      checkpoint llama-1b-gqa
      for q in ${QUANT_METHODS:-fp8 mxfp4 nvfp4}; do
        stage "e2e-1b-$q" 170 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
            --batches 1,8,32 --prefill "" --quantization "$q" \
            --engine-args '{"quantization_calibration": "rtn"}' --out "$out/e2e_1b_$q.json"
      done ;;
    copies)    # weight copies the compiled steps make (benchmarks/hlo_param_copies.py over XLA's dump:
               # the entry computation's weight copies and the data-movement writes in layer loops),
               # the 1B shape at b1 per weight format and gpt-oss's 2-layer shape: COPIES_METHODS
               # from bf16 (no quantization) fp8 mxfp4 nvfp4 gptoss (gpt-oss-20b-2l, made as the
               # header says). 2026-12-07: NVFP4's per-step scale copies found here (fixed f8fd672)
      for q in ${COPIES_METHODS:-bf16 fp8 mxfp4 nvfp4 gptoss}; do
        if [ "$q" = gptoss ]; then
          model=gpt-oss-20b-2l; qarg=(); args='{"warmup": false}'
          [ -d /tmp/m/$model ] || python benchmarks/random_checkpoint.py --dtype float16 \
              --like .tpu_carry/shapes/$model --out /tmp/m/$model > /dev/null
        else
          model=llama-1b-gqa; qarg=(); args='{"quantization_calibration": "rtn", "warmup": false}'
          [ "$q" != bf16 ] && qarg=(--quantization "$q")
          checkpoint $model
        fi
        rm -rf "/tmp/xdump-$q"
        XLA_FLAGS="--xla_dump_to=/tmp/xdump-$q --xla_dump_hlo_module_re=.*_step.*" stage "copies-$q" 150 \
            python benchmarks/tpu_e2e.py --models /tmp/m/$model --rounds 1 --batches 1 --prefill "" \
            "${qarg[@]}" --engine-args "$args" --out "$out/copies_$q.json"
        python benchmarks/hlo_param_copies.py "/tmp/xdump-$q" | tee "$out/copies_$q.txt" | head -n 16
      done ;;
    prefill-sweep) # block sizes for chunked prefill of one long prompt at the 1B heads (32 q / 8 KV,
               # d 64): 1 x 8192 sat at 44.7-45.6% MFU (2026-12-06/07) against 66% for 8 x 1024;
               # the defaults (64 queries x 512 tokens) came from a 4 x 512 @ 4k sweep at d 128
      stage prefill-sweep "${PSWEEP_LIMIT_S:-240}" python benchmarks/attention_tpu.py --sweep --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --sweep-prefill 1024x2048,1024x8192 --sweep-prefill-bqs 64,128,256 \
          --sweep-prefill-ppbs 32,64,128 --out "$out/prefill_sweep.json" ;;
    prefill-whole) # mask-free items (a query block that sees a whole KV block) and queries scaled
               # before the kernel (2026-12-07 afternoon): checked compiled, the prefill sweep again
               # (bq 256 and 64-page blocks with 64 MiB of scoped VMEM), then the 1B's prefill end to end
      stage whole-check 150 python benchmarks/attention_tpu.py --rpa-v3 off --checks-only \
          --check-dtypes bfloat16 --check-options plain,window_cap --out "$out/whole_check.json"
      stage whole-sweep "${PSWEEP_LIMIT_S:-200}" python benchmarks/attention_tpu.py --sweep --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --sweep-prefill 1024x2048,1024x8192 --sweep-prefill-bqs 64,128,256 \
          --sweep-prefill-ppbs 32,64 --sweep-vmem-mib 64 --out "$out/whole_sweep.json"
      checkpoint llama-1b-gqa
      stage whole-e2e 150 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
          --batches "" --engine-args '{"warmup": false}' --out "$out/whole_e2e.json" ;;
    prefill-kv1024) # 1024-token prefill KV blocks with 64 MiB of scoped VMEM (v5e default since
               # 2026-12-07 afternoon): checked compiled at the defaults, the 1B's prefill A/B against
               # the 512-token blocks at Mosaic's default VMEM, the 8B FP8 prefill at the defaults
      stage kv1024-check 110 python benchmarks/attention_tpu.py --rpa-v3 off --checks-only \
          --check-dtypes bfloat16 --check-options plain --out "$out/kv1024_check.json"
      checkpoint llama-1b-gqa
      for blocks in '{"kv_tokens_per_block": 512, "vmem_limit_bytes": null}' '{}'; do
        tag=$([ "$blocks" = '{}' ] && echo 1024 || echo 512)
        [ "$tag" = 512 ] && [ -n "${SKIP_KV512:-}" ] && continue  # the A side, when already measured
        stage "kv1024-e2e-kv$tag" 100 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
            --batches "" --block-sizes "$blocks" --engine-args '{"warmup": false}' --out "$out/kv1024_e2e_kv$tag.json"
      done
      [ -d /tmp/m/llama-8b-fp8 ] || python benchmarks/random_checkpoint.py --quantize fp8 --dtype float16 \
          --like .tpu_carry/shapes/llama-8b-gqa --out /tmp/m/llama-8b-fp8 > /dev/null
      stage kv1024-8b 170 python benchmarks/tpu_e2e.py --models /tmp/m/llama-8b-fp8 --rounds 1 \
          --batches "" --engine-args '{"warmup": false}' --out "$out/kv1024_8b.json" ;;
    lanes-hd64) # the lane-packed head_dim-64 cache (pack_kv_lanes, half the bytes) compiled: checked on
               # every option (bf16 + f32, both paths), then against kernel_hd64 at the 1B heads
      stage lanes-checks 150 python benchmarks/attention_tpu.py --checks-only --rpa-v3 off --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --kv-layout lanes --check-dtypes bfloat16 \
          --check-options plain,window_cap,sinks,one_item --check-batches decode,mixed --out "$out/lanes_checks.json"
      stage lanes-decode "${HD64_LIMIT_S:-240}" python benchmarks/attention_tpu.py --rpa-v3 require --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --kv-layout lanes --check-dtypes bfloat16 --check-options plain \
          --check-batches decode --steps decode --batches 32,128 --contexts 192,1024 --out "$out/lanes_decode.json" ;;
    fused)     # the one-item decode path with every KV head in one matmul pair (fused_heads,
               # docs/plans/short-row-decode.md steps 3-4): checked compiled, timed at two chunk sizes
               # x 1 / 4 / 8 tokens a grid step beside the per-head path and kernel_hd64 on the 1B
               # heads, then end to end at b32 / b128 with it on (A/B against e2e-1b's numbers)
      stage fused-checks 120 python benchmarks/attention_tpu.py --checks-only --rpa-v3 off --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --kv-layout lanes --check-dtypes bfloat16 \
          --check-options one_item_fused,one_item_fused_window_cap --check-batches decode,mixed \
          --out "$out/fused_checks.json"
      stage fused-kernel 200 python benchmarks/attention_tpu.py --rpa-v3 require --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --kv-layout lanes --check-dtypes bfloat16 --check-options plain \
          --check-batches decode --steps decode --batches 32,128 --contexts 192,1024 \
          --fused-chunk-rows "${FUSED_ROWS:-1024,2048}" --fused-items "${FUSED_ITEMS:-1,4,8}" \
          --out "$out/fused_kernel.json"
      checkpoint llama-1b-gqa
      stage fused-e2e 200 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
          --batches 32,128 --prefill "" --block-sizes "{\"fused_head_decode\": true, \"fused_chunk_rows\": ${FUSED_E2E_ROWS:-1024}, \"fused_items\": ${FUSED_E2E_ITEMS:-8}}" \
          --out "$out/e2e_1b_fused.json" ;;
    fused-default) # the 1B shape end to end with the generation's defaults (fused-heads decode on
               # for buckets of <= 256 tokens), 2 rounds; then 4 tokens a grid step asked for
               # explicitly (2026-12-07 the default was 8 here, 4 after this stage measured both)
      checkpoint llama-1b-gqa
      stage fused-default 200 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 2 \
          --batches 1,32,128 --prefill "" --out "$out/e2e_1b_default.json"
      stage fused-items4 150 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 2 \
          --batches 128 --prefill "" --block-sizes '{"fused_items": 4}' --out "$out/e2e_1b_items4.json" ;;
    lanes-fp8) # the lane-packed FP8 cache (four heads' codes a word, 1 KiB a token a layer at the 1B
               # shape) compiled: checked, then its b128 decode beside the bf16 lane-packed one
      stage lanes-fp8 200 python benchmarks/attention_tpu.py --rpa-v3 off --num-q-heads 32 --num-kv-heads 8 \
          --head-dim 64 --kv-layout lanes --kv-dtype bfloat16,fp8 --check-dtypes fp8 \
          --check-options plain,window_cap,sinks,one_item --check-batches decode,mixed --steps decode \
          --batches 128 --contexts 1024 --out "$out/lanes_fp8.json" ;;
    e2e-1b-kv8) # the 1B shape's decode with an FP8 KV cache (lane-packed since 2026-12-07: 1 KiB a
               # token a layer), as e2e-1b's decode points: what --kv-cache-dtype fp8 costs a user
      checkpoint llama-1b-gqa
      stage e2e-1b-kv8 220 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
          --batches 1,32,128 --prefill "" --engine-args '{"kv_cache_dtype": "fp8"}' \
          --out "$out/e2e_1b_kv8.json" ;;
    lanes-mixed) # the same layout on the prefill and mixed steps, against kernel_hd64
      stage lanes-mixed 200 python benchmarks/attention_tpu.py --rpa-v3 require --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --kv-layout lanes --check-dtypes bfloat16 --check-options plain \
          --check-batches mixed --steps prefill,mixed --out "$out/lanes_mixed.json" ;;
    layout-probe) # how XLA stores the dense head_dim-64 page candidates (HBM bytes, tiling) and whether
               # a Pallas call reads them through a uint32 view and writes a token in place
               # (docs/plans/dense-hd64-cache.md, the chip's first check)
      stage layout-probe 120 python benchmarks/tpu_layout_probe.py --out "$out/layout_probe.json" ;;
    rpa-hd64) # tpu-inference's head_dim-64 variant (what it runs for d64 models, a dense cache) beside
               # ours at the 1B heads' b128 x 192 decode, the step issue 30's b128 point is made of
      stage rpa-hd64 "${HD64_LIMIT_S:-200}" python benchmarks/attention_tpu.py --rpa-v3 require --num-q-heads 32 \
          --num-kv-heads 8 --head-dim 64 --check-dtypes bfloat16 --check-options plain --check-batches decode \
          --steps decode --batches 128 --contexts 192,1024 --out "$out/rpa_hd64.json" ;;
    prefill-bq) # the 1B shape's prefill with 64 (the v5e default) and 128 queries a block end to end:
               # the kernel sweep (2026-12-07) gave bq 128 1.17x on a 1024-token chunk at 2k
               # context, 1.02x at 8k (d 64; wider blocks ran out of scoped VMEM)
      checkpoint llama-1b-gqa
      for bq in 64 128; do
        stage "prefill-bq$bq" 150 python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --rounds 1 \
            --batches "" --block-sizes "{\"num_queries_per_block\": $bq}" \
            --engine-args '{"warmup": false}' --out "$out/prefill_bq$bq.json"
      done ;;
    prefill-bq-8b) # the same at the 8B shape (FP8 checkpoint; head_dim 128: twice the 1B's q/acc
               # VMEM a query block): whether 128 queries a block still fits and wins there
      [ -d /tmp/m/llama-8b-fp8 ] || python benchmarks/random_checkpoint.py --quantize fp8 --dtype float16 \
          --like .tpu_carry/shapes/llama-8b-gqa --out /tmp/m/llama-8b-fp8 > /dev/null
      for bq in 64 128; do
        stage "prefill-bq$bq-8b" 170 python benchmarks/tpu_e2e.py --models /tmp/m/llama-8b-fp8 --rounds 1 \
            --batches "" --block-sizes "{\"num_queries_per_block\": $bq}" \
            --engine-args '{"warmup": false}' --out "$out/prefill_bq${bq}_8b.json"
      done ;;
    prefill-defaults) # the default prefill blocks (128 queries on v5e since 2026-12-07) compiled
               # and checked against the reference at the 1B and 8B heads, then end to end on the
               # wide-row SmolLM2-1.7B shape (64 combined heads of d 64) and the 135M
      stage prefill-defaults-check 150 python benchmarks/attention_tpu.py --rpa-v3 off --checks-only \
          --check-dtypes bfloat16 --check-options plain --out "$out/prefill_defaults_check.json"
      for model in smollm2-1.7b smollm2-135m; do
        checkpoint $model
        stage "prefill-defaults-$model" 120 python benchmarks/tpu_e2e.py --models /tmp/m/$model --rounds 1 \
            --batches "" --engine-args '{"warmup": false}' --out "$out/prefill_defaults_$model.json"
      done ;;
    parts)     # where a decode step's device time goes: matmuls alone, empty steps per bucket, the
               # optimized HLO of the 1- and 128-token steps with a trace of each, ops by device time
               # (2026-12-06: a ~45 us fusion a layer beside the four matmuls, unidentified)
      stage parts 240 python benchmarks/tpu_step_parts.py --model llama-1b --rows 1,128 --buckets 1,8,128 \
          --impls auto --hlo-buckets 1,128 --trace --out "$out/parts"
      find "$out/parts" -name "*.xplane.pb" -size +8M -delete ;;
    *) echo "unknown stage $s" | tee -a "$out/session.log" ;;
  esac
done
echo "done in $(( $(date +%s) - start )) s" | tee -a "$out/session.log"
# The device tool brings back a limited number of files (on 2026-12-07 a call's copies_*.txt were
# left behind): everything the stages wrote goes back as one archive (PACK=0 keeps the files loose).
if [ "${PACK:-1}" = 1 ]; then
  tar czf /tmp/tpu_session_all.tgz -C "$out" . && find "$out" -mindepth 1 -delete \
      && mv /tmp/tpu_session_all.tgz "$out/session_all.tgz" && echo "packed into $out/session_all.tgz"
fi
