#!/usr/bin/env bash
# One GPU session (the device tool's machine): install what the image lacks, then run the named phases in order.
# Results of every phase are collected under $FLY_RESULTS_DIR and returned as one archive plus the log
# (the device tool returns at most 8 files).
#
#   bash benchmarks/gpu_session.sh tests                     # the GPU tests (tests/gpu), JUnit XML in the archive
#   bash benchmarks/gpu_session.sh rms route grouped_all     # suites, each writing <suite>.json/.md
#
# Phases: tests, rms, route, route_floor, grouped, grouped_all, roof, moe, mx_cast, mx_dequantize, mx_gemm, mx_grouped, mx_linear, mx_memory, mx_quality, mx_w4_probe, mx_w4_floor, mx_event_probe, mx_fp8bw_probe, mx_fq_probe, mx_gap_probe, mx_swap_probe, mx_swap_band, mx_ws_probe, mx_overlap_probe, host, overhead, train_step, cold_start, recipe_step,
# recipe_step_small, recipe. FLY_PYTEST_ARGS adds arguments to the tests phase's pytest (split on spaces), FLY_PYTEST_K
# a -k expression (kept whole: "geglu or mx").
# The suites need .whl/ (../shared/tools/gpu-wheels.sh jsonargparse docstring-parser typeshed-client) carried along;
# the tests phase runs on the image's packages alone.
# Pass the revision literally (FLY_GIT_REV=<rev> bash benchmarks/gpu_session.sh ...): on the device copy of the tree,
# `git rev-parse HEAD` once reported an older commit than the one whose files ran.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# emptied first: a device machine can keep /tmp between sessions, and stale results would ride along in the archive
export FLY_RESULTS_DIR=/tmp/fly_results; rm -rf "$FLY_RESULTS_DIR"; mkdir -p "$FLY_RESULTS_DIR"
export FLY_GIT_REV=${FLY_GIT_REV:-unknown}
repo=$PWD
tag=$(echo "$*" | tr ' ' '_')
log="$OUT/session-$tag.log"
{
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; exit 1; }
  else
    echo "no .whl/ carried: the image's packages only"; mkdir -p /tmp/site
  fi
  # the package as an install lays it out, without needing a build backend there
  rm -rf /tmp/site/fly_lightning && cp -r fly_lightning /tmp/site/fly_lightning
  rm -rf /tmp/site/benchmarks && cp -r benchmarks /tmp/site/benchmarks
} >"$log" 2>&1
# run outside the checkout: its fly_lightning/ on sys.path[0] would shadow the laid-out package
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
mkdir -p /tmp/run && cd /tmp/run
status=0
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$log"
  local t0=$SECONDS
  # empty Triton and Inductor caches per phase: the suites' cold-start columns (*_cold_s, peer_compile_s) then count
  # every compilation, whatever ran before on this machine
  local caches; caches=$(mktemp -d /tmp/fly-caches.XXXXXX)
  TRITON_CACHE_DIR=$caches/triton TORCHINDUCTOR_CACHE_DIR=$caches/inductor timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  rm -rf "$caches"
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
  [ $rc -eq 0 ] || status=1
  # archive after every phase: a run cut short by the device limit still returns what finished
  tar czf "$OUT/results-$tag.tgz" -C "$FLY_RESULTS_DIR" . 2>>"$log"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv;
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; } \
  >>"$log" 2>&1
for phase in "$@"; do
  case $phase in
    # the tests from the checkout, the package from /tmp/site; TRITON_INTERPRET=0 overrides tests/conftest.py's
    # CPU default (the interpreter); xunit1 keeps the tests' recorded properties (residuals, losses) in the XML
    tests) run tests 540 env TRITON_INTERPRET=0 python3 -m pytest "$repo/tests/gpu" -m gpu -q -rfEsx \
             --rootdir "$repo" -p no:cacheprovider --junitxml "$FLY_RESULTS_DIR/tests_gpu.xml" -o junit_family=xunit1 \
             ${FLY_PYTEST_K:+-k "$FLY_PYTEST_K"} ${FLY_PYTEST_ARGS:-} ;;
    rms) run rms 300 python3 -m benchmarks.bench_rms_norm ;;
    route) run route 300 python3 -m benchmarks.bench_moe_route ;;
    route_floor) run route_floor 540 python3 -m benchmarks.bench_moe_route_floor ;;
    grouped) run grouped 540 python3 -m benchmarks.bench_grouped_mm ;;
    grouped_all) run grouped_all 570 python3 -m benchmarks.bench_grouped_mm --peer all ;;
    roof) run roof 300 python3 -m benchmarks.bench_gemm_roof ;;
    # FLY_MOE_ARGS narrows or extends the MoE block suite (models, Liger, compile, profiled variants)
    moe) run moe 420 python3 -m benchmarks.bench_moe_layer ${FLY_MOE_ARGS:-} ;;
    mx_cast) run mx_cast 300 python3 -m benchmarks.bench_mx_cast ;;
    mx_dequantize) run mx_dequantize 300 python3 -m benchmarks.bench_mx_dequantize ;;
    mx_gemm) run mx_gemm 540 python3 -m benchmarks.bench_mx_gemm ;;
    mx_grouped) run mx_grouped 540 python3 -m benchmarks.bench_mx_grouped_mm ;;
    mx_linear) run mx_linear 300 python3 -m benchmarks.bench_mx_linear ;;
    mx_memory) run mx_memory 300 python3 -m benchmarks.bench_mx_memory ;;
    # the MX quality comparison (same fine-tune in bf16 / MXFP8 / MXFP4); it also runs on a CPU
    mx_quality) run mx_quality 540 python3 -m benchmarks.bench_mx_quality ;;
    # a probe (prints, no suite file): weight-only MXFP4 plans and Triton's tl.dot_scaled against ours
    mx_w4_probe) run mx_w4_probe 300 python3 -m benchmarks.probe_mx_weight_only ;;
    mx_w4_floor) run mx_w4_floor 300 python3 -m benchmarks.probe_mx_w4_floor ;;
    # a probe (prints, and probe_mx_event.json in the archive): event time against host and device time, mx_gemm
    mx_event_probe) run mx_event_probe 300 python3 -m benchmarks.probe_mx_event ;;
    # a probe (prints): MX operands as fp8 with 1x128 scales, cuBLAS's blockwise fp8 GEMM against the prepass plan
    mx_fp8bw_probe) run mx_fp8bw_probe 300 python3 -m benchmarks.probe_mx_fp8_blockwise ;;
    # a probe (prints): launch plans of the column-wise mx_fake_quantize
    mx_fq_probe) run mx_fq_probe 200 python3 -m benchmarks.probe_mx_fake_quant_cols ;;
    # a probe (prints): the layers of mx_grouped_mm's public call against its prepass column, Mixtral's shapes
    mx_gap_probe) run mx_gap_probe 300 python3 -m benchmarks.probe_mx_grouped_gap ;;
    # a probe (prints): swapped MX grouped tiles for many rows per group against the prepass plan; --band: the tiles
    # of 64 and 128 rows and the in-loop ones at 64-128 rows per group
    mx_swap_probe) run mx_swap_probe 540 python3 -m benchmarks.probe_mx_swap_tiles ;;
    mx_swap_band) run mx_swap_band 300 python3 -m benchmarks.probe_mx_swap_tiles --band ;;
    # a probe (prints): the warp-specialised Gluon MX grouped kernel against the bf16 grouped GEMM and the plan
    mx_ws_probe) run mx_ws_probe 300 python3 -m benchmarks.probe_mx_ws_gluon ;;
    # a probe (prints): the prepass plan's weight conversion overlapped with the bf16 GEMM on a second stream
    mx_overlap_probe) run mx_overlap_probe 300 python3 -m benchmarks.probe_mx_prepass_overlap ;;
    # FLY_AGAINST=<dir holding another fly_lightning/>: that copy timed too, in alternating processes
    host) run host 300 python3 -m benchmarks.profile_host ;;
    overhead) run overhead 300 python3 -m benchmarks.bench_dispatch_overhead ${FLY_AGAINST:+--against "$FLY_AGAINST"} ;;
    # FLY_TRAIN_STEP_ARGS narrows the whole-step suite (models, variants, precisions, rounds) to fit one call
    train_step) run train_step 560 python3 -m benchmarks.bench_train_step ${FLY_TRAIN_STEP_ARGS:-} ;;
    # FLY_COLD_ARGS: the model (default qwen3_moe); each run in the suite gets its own cache directories
    cold_start) run cold_start 560 python3 -m benchmarks.bench_cold_start ${FLY_COLD_ARGS:-} ;;
    recipe_step) run recipe_step 420 python3 -m benchmarks.bench_recipe_step ;;
    recipe_step_small) run recipe_step 240 python3 -m benchmarks.bench_recipe_step --only recipe-1024 ;;
    # the recipe's own GPU run (not a suite): its log directory, dispatch manifest and op_time land in the archive
    recipe) run recipe 300 python3 -m fly_lightning.recipes.moe_finetune fit --trainer.max_steps 60 \
              --trainer.default_root_dir "$FLY_RESULTS_DIR/recipe" --model.hidden_size 1024 --model.num_layers 4 \
              --model.num_heads 16 --model.num_kv_heads 4 --model.num_experts 16 --model.experts_per_token 4 \
              --model.expert_intermediate_size 768 --model.max_seq_len 2048 --data.seq_len 1025 --data.n_train 1024 \
              --data.batch_size 8 --trainer.val_check_interval 30 ;;
    *) echo "unknown phase $phase" | tee -a "$log"; status=1 ;;
  esac
done
tail -40 "$log"
exit $status
