#!/usr/bin/env bash
# Nsight Compute profile of the routing kernel (benchmarks/profile_route_ncu.py), exported as text next to the report:
# the details page (speed of light, warp states, pipes, occupancy), every raw metric, and the SASS with per-instruction
# counters. Run from gpu_session.sh (PYTHONPATH and FLY_RESULTS_DIR set there). --clock-control none: the device notes
# ask to leave the clocks alone.
set -uo pipefail
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu found"; exit 1; }
"$ncu" --version
rep="$FLY_RESULTS_DIR/route_ncu"
"$ncu" --clock-control none --profile-from-start off -k regex:_moe_route_fwd --set full --import-source yes -f \
  -o "$rep" python3 -m benchmarks.profile_route_ncu --spread "$@" || exit 1
"$ncu" -i "$rep.ncu-rep" --page details --csv >"$rep.details.csv"
"$ncu" -i "$rep.ncu-rep" --page raw --csv >"$rep.raw.csv"
"$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.sass.csv" \
  || echo "source page export failed (see above)"
ls -la "$FLY_RESULTS_DIR"
