#!/usr/bin/env bash
# One GPU session (the device tool's machine): install what the image lacks, then run the named phases.
# Results of every suite are collected under $FLY_RESULTS_DIR and returned as one archive plus the log
# (the device tool returns at most 8 files).
#
#   bash benchmarks/gpu_session.sh checks rms route callbacks recipe     # phases, in order
#
# Needs .whl/ (../shared/tools/gpu-wheels.sh jsonargparse docstring-parser typeshed-client) carried along.
# Pass the revision literally (FLY_GIT_REV=<rev> bash benchmarks/gpu_session.sh ...): on the device copy of the tree,
# `git rev-parse HEAD` once reported an older commit than the one whose files ran.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# emptied first: a device machine can keep /tmp between sessions, and stale results would ride along in the archive
export FLY_RESULTS_DIR=/tmp/fly_results; rm -rf "$FLY_RESULTS_DIR"; mkdir -p "$FLY_RESULTS_DIR"
export FLY_GIT_REV=${FLY_GIT_REV:-unknown}
tag=$(echo "$*" | tr ' ' '_')
log="$OUT/session-$tag.log"
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  # the package as an install lays it out (pyproject's package-dir mapping), without needing a build backend there
  rm -rf /tmp/site/fly_lightning && cp -r fly_lightning /tmp/site/fly_lightning
  for d in kernels quant callbacks recipes; do cp -r "$d" "/tmp/site/fly_lightning/$d"; done
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
    checks) run checks 300 python3 -m benchmarks.gpu_checks ;;
    rms) run rms 300 python3 -m benchmarks.bench_rms_norm --sweep ;;
    rms_unaligned) run rms_unaligned 300 python3 -m benchmarks.sweep_rms_norm_unaligned ;;
    rms_rows) run rms_rows 300 python3 -m benchmarks.sweep_rms_norm_rows ;;
    grouped_check) run grouped_check 360 python3 -m benchmarks.bench_grouped_mm --check --moe ;;
    moe) run moe 300 python3 -m benchmarks.bench_grouped_mm --moe ;;
    overhead) run overhead 120 python3 -m benchmarks.bench_dispatch_overhead ;;
    route) run route 300 python3 -m benchmarks.bench_moe_route ;;
    probe) run probe 120 python3 -m benchmarks.probe_histogram_mask ;;
    route_host) run route_host 180 python3 -m benchmarks.probe_route_host ;;
    route_sweep) run route_sweep 420 python3 -m benchmarks.bench_moe_route --sweep ;;
    route_pipeline) run route_pipeline 300 python3 -m benchmarks.bench_moe_route --sweep --pipeline ;;
    route_floor) run route_floor 420 python3 -m benchmarks.probe_route_floor ;;
    route_score_floor) run route_score_floor 540 python3 -m benchmarks.probe_route_floor \
                         --floors copy,copy_counts,copy_packed,score_tail ;;
    route_spread) run route_spread 300 python3 -m benchmarks.probe_route_spread ;;
    route_variants) run route_variants 420 python3 -m benchmarks.probe_route_variants ;;
    route_ncu) run route_ncu 400 bash /tmp/site/benchmarks/ncu_route.sh ;;
    grouped) run grouped 540 python3 -m benchmarks.bench_grouped_mm ;;
    grouped_all) run grouped_all 570 python3 -m benchmarks.bench_grouped_mm --peer all ;;
    roof) run roof 300 python3 -m benchmarks.probe_gemm_roof ;;
    grouped_spec) run grouped_spec 480 python3 -m benchmarks.probe_grouped_mm_specialize ;;
    grouped_sweep) run grouped_sweep 540 python3 -m benchmarks.bench_grouped_mm --sweep ;;
    moe_profile) run moe_profile 300 python3 -m benchmarks.profile_moe_layer ;;
    callbacks) run callbacks 240 python3 -m benchmarks.gpu_check_callbacks ;;
    recipe) run recipe 300 python3 -m fly_lightning.recipes.moe_finetune fit --trainer.max_steps 60 \
              --trainer.default_root_dir "$FLY_RESULTS_DIR/recipe" --model.hidden_size 1024 --model.num_layers 4 \
              --model.num_heads 16 --model.num_kv_heads 4 --model.num_experts 16 --model.experts_per_token 4 \
              --model.expert_intermediate_size 768 --model.max_seq_len 2048 --data.seq_len 1025 --data.n_train 1024 \
              --data.batch_size 8 --trainer.val_check_interval 30 ;;
    recipe_step) run recipe_step 420 python3 -m benchmarks.bench_recipe_step ;;
    recipe_step_small) run recipe_step 240 python3 -m benchmarks.bench_recipe_step --only recipe-1024 ;;
    dist) run dist 420 python3 -m benchmarks.distributed_check ;;
    *) echo "unknown phase $phase" | tee -a "$log"; status=1 ;;
  esac
done
tail -40 "$log"
exit $status
