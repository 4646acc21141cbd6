#!/bin/sh
# A run of the main job killed mid-way (as the OOM killer would) ends the whole job with an error
# naming it, never a hang: the runs take turns around a ring of pipes (examples/train_lm/main.cpp),
# and the killed run's pipe end closes, so the next run's wait sees end of file, and so on.
#   train_lm_killed_run.sh TRAIN_LM OUT_DIR
# Fails if train_lm does not exit within 120 s of the kill (and then kills what is left of it).
train_lm="$1" out="$2"
mkdir -p "$out"
"$train_lm" --steps 100000 --quiet --optimizers adamw,wavelet-haar-l2,wavelet-db2-l2 \
  --out "$out" >"$out/log" 2>&1 &
pid=$!
i=0
while [ "$(pgrep -P "$pid" | wc -l)" -lt 3 ] && [ $i -lt 300 ]; do sleep 0.2; i=$((i + 1)); done
sleep 2  # into the training loop
victim=$(pgrep -P "$pid" | sed -n 2p)
[ -n "$victim" ] || { echo "no second run to kill"; kill -9 "$pid"; exit 1; }
echo "killing run process $victim"
kill -9 "$victim"
# The watchdog does not hold the test's output open (ctest would wait for its sleep).
# Killing its sleep (below) ends it without acting.
( sleep 120 && { echo "train_lm still running 120 s after the kill: killing it" >>"$out/log"; \
  pkill -9 -P "$pid"; kill -9 "$pid"; } ) >/dev/null 2>&1 &
watchdog=$!
wait "$pid"
rc=$?
pkill -P "$watchdog" 2>/dev/null
kill "$watchdog" 2>/dev/null
cat "$out/log"
pkill -9 -P "$pid" 2>/dev/null  # nothing should be left; never leave runs behind
[ "$rc" -eq 1 ] || { echo "train_lm exited $rc, expected 1"; exit 1; }
grep -q 'train_lm: error: run .* was killed (signal 9)' "$out/log" ||
  { echo "no error naming the killed run"; exit 1; }
# The other two stopped because the ring did, not by the watchdog (which would give rc 137).
[ "$(grep -c 'another run stopped, so this one stops too' "$out/log")" -eq 2 ] ||
  { echo "the other runs did not stop through the ring"; exit 1; }
