# The next session's first device call (written 2026-12-06, eleventh session), run as it stands from the repository
# root on the GPU machine (carry .bench, timeout 600): bench/PLAN.md's levers 0 and 1 in one call, each 3 pairs
# against the one-GPU defaults of 2026-12-06 (a lever call of 3 pairs took 243-297 s on the H100 of that session).
o=$OUT; mkdir -p $o/gl $o/oct; s=$SECONDS
OUT=$o/gl bash bench/device_call.sh lever --gpus 1 --lever graphed_loss=1 --deadline-s 320
left=$((580 - SECONDS + s))
if [ $left -gt 240 ]; then OUT=$o/oct bash bench/device_call.sh lever --gpus 1 --lever one_cpu_thread=1 --deadline-s $left; fi
