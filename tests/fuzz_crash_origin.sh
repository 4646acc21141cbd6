#!/bin/sh
# scripts/fuzz_crash_origin.sh on the crash reports in tests/data/fuzz_reports: each file's name
# starts with the verdict it must get ("libtorch_" or "gwt_"). libtorch_unpickler_oom.txt is the
# stack of a CI run's report (2026-12-06, fuzz_compression, under a libFuzzer header);
# libtorch_replay_allocator_oom.txt is scripts/fuzz.sh's replay of a hand-made input of that kind
# (fuzz/corpus/compression) against the screen before its fix. The gwt_ ones change one frame of
# the first, or are written in the sanitizers' format, so that each rule of the script decides
# one of them (each rule, removed, fails a file).
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
failed=0 checked=0
for report in "$root"/tests/data/fuzz_reports/*.txt; do
  name="$(basename "$report")"
  want="${name%%_*}"
  got="$("$root/scripts/fuzz_crash_origin.sh" "$report")"
  checked=$((checked + 1))
  if [ "$got" != "$want" ]; then
    echo "FAIL $name: said '$got', want '$want'"
    failed=1
  fi
done
[ "$checked" -ge 12 ] || { echo "FAIL: only $checked reports found"; exit 1; }
[ "$failed" -eq 0 ] && echo "ok: $checked reports"
exit "$failed"
