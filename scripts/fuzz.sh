#!/usr/bin/env bash
# Builds gwt's libFuzzer targets (fuzz/) with clang, AddressSanitizer and UndefinedBehaviorSanitizer
# into build-fuzz/ and runs each for SECONDS on a copy of its committed seed corpus.
#
#   scripts/fuzz.sh SECONDS [target...]     targets: transform step galore load compression adapters
#                                          (default all)
#
# One line per target (executions, rate, crashes) and a total; exits non-zero if any target
# crashed (the input is kept as fuzz/crashes/<target>-crash-*, reproduce it with
# build-fuzz/fuzz/gwt_fuzz_<target> <file>) or could not run. A crash inside LibTorch's archive
# reader before any gwt code saw the input (scripts/fuzz_crash_origin.sh, on a replay of the
# input) is reported with its input and does not count; the target goes on with the next seed. A
# fourth in one target does count: the screen of fuzz/libtorch_guard.h would then need mending.
#
# Environment: GWT_FUZZ_BUILD (build dir, default build-fuzz), GWT_JOBS (build jobs),
# GWT_FUZZ_RUNS=N (also stop a target after N executions, whichever of the two comes first),
# GWT_FUZZ_SEED=N (libFuzzer's -seed: the same seed, corpus and binary replay the same inputs in
# the same order from any clone on the same CPU model (docs/notes/fuzzing.md; another model is not
# measured since the remedies of 2026-12-06), as long as the run ends by GWT_FUZZ_RUNS rather than
# SECONDS (see below); so a gate that runs a fixed number of executions passes where the same
# command passed before the commit on that CPU model; unset, each run draws a seed and
# explores new inputs, which is what a developer's run is for),
# GWT_FUZZ_MERGE=1 (merge the inputs that found new coverage back into fuzz/corpus/<target>),
# GWT_FUZZ_NOTES=<dir> (inputs of the targets' notes, see fuzz/fuzz_util.h),
# GWT_FUZZ_LOGS=<dir> (keep libFuzzer's logs there, <target>.<part>.log: two runs of one seed can
# be compared line for line).
set -euo pipefail

usage() { echo "usage: scripts/fuzz.sh SECONDS [transform|step|galore|load|compression|adapters ...]" >&2; exit 2; }
[[ $# -ge 1 && "$1" =~ ^[0-9]+$ && "$1" -ge 1 ]] || usage
seconds="$1"; shift
all_targets=(transform step galore load compression adapters)
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "scripts/fuzz.sh: unknown target '$t'" >&2; usage; }
done
# libFuzzer takes -seed=0 as "draw one".
[[ -z "${GWT_FUZZ_SEED:-}" || "$GWT_FUZZ_SEED" =~ ^[1-9][0-9]{0,8}$ ]] \
  || { echo "scripts/fuzz.sh: GWT_FUZZ_SEED must be a whole number from 1 to 999999999" >&2; exit 2; }
[[ -z "${GWT_FUZZ_RUNS:-}" || "$GWT_FUZZ_RUNS" =~ ^[1-9][0-9]{0,9}$ ]] \
  || { echo "scripts/fuzz.sh: GWT_FUZZ_RUNS must be a whole number of executions (digits only)" >&2; exit 2; }

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=setup.sh
source "$root/scripts/setup.sh"
# Debian 12: clang 14; libFuzzer and the sanitizer runtimes are in libclang-rt-14-dev, the
# symbolizer for readable stacks in llvm-14.
gwt_setup clang libclang-rt-14-dev llvm-14

build="${GWT_FUZZ_BUILD:-$root/build-fuzz}"
mkdir -p "$build"
build="$(cd "$build" && pwd)"  # absolute: the fuzzer runs in the root (below)
start=$(date +%s)
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ "-DTorch_DIR=$GWT_TORCH_DIR" -DGWT_BUILD_FUZZERS=ON \
    -DGWT_BUILD_TESTS=OFF -DGWT_BUILD_EXAMPLES=OFF -DGWT_CUDA=OFF >"$build/configure.log" 2>&1; then
  cat "$build/configure.log" >&2
  exit 1
fi
# shellcheck disable=SC2046
cmake --build "$build" --parallel "${GWT_JOBS:-$(nproc)}" \
  --target $(printf 'gwt_fuzz_%s ' "${targets[@]}") >"$build/build.log" 2>&1 \
  || { tail -50 "$build/build.log" >&2; exit 1; }
echo "fuzz: built in $(($(date +%s) - start)) s ($build)"
# The clang build of the AVX2 kernel files (clang's pragma, src/kernels/avx2/avx2_target.h): no AVX code
# in a function other files may share, as ctest checks the GCC build.
[[ "$(uname -m)" != x86_64 ]] || python3 "$root/tests/isa_check.py" "$build" || exit 1

# LibTorch is not instrumented and keeps allocations in globals for the life of the process:
# leak checking would only report those. A huge allocation is an error the code must handle
# (c10::Error from LibTorch's allocator), not an abort.
ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:${ASAN_OPTIONS:-}"
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=fuzz/ubsan.supp:${UBSAN_OPTIONS:-}"
symbolizer="$(command -v llvm-symbolizer || command -v llvm-symbolizer-14 || true)"
[[ -n "$symbolizer" ]] && symbolizer="$(readlink -f "$symbolizer")"  # one path, whatever PATH says

# The targets run so that a seed replays a run input for input from any clone, on a machine with
# the same CPU model, the same LibTorch at the same path and the same compiler (docs/notes/fuzzing.md:
# runs parted with the paths, the environment, address randomisation or -reload left out, and
# agreed line for line with all of them, also from another clone; two CPU models parted in all
# six targets before the last two items below, which make runs whose heap was moved on purpose
# agree, docs/notes/fuzzing.md):
# - the fuzzer runs in the repository's root with relative paths (binary, crash prefix, UBSan's
#   suppressions) and a corpus directory whose path has a fixed length: a path's length moves the
#   heap, LibTorch's optimizers keep state in maps keyed by addresses, and the coverage saw how
#   those maps probe (before the ignorelist below);
# - a fixed environment (env -i), for the same reason;
# - no address randomisation (setarch -R), where the kernel allows it;
# - MKL, ATen and oneDNN on fixed code paths (MKL_CBWR=COMPATIBLE; ATEN_CPU_CAPABILITY=avx2 and
#   ONEDNN_MAX_CPU_ISA=AVX2 where the CPU has AVX2), so that results, and the branches gwt takes
#   on them, depend less on the CPU and not on the data's alignment;
# - libFuzzer's -reload=0: it otherwise re-reads its corpus directory every second and runs what
#   it finds there, at moments that depend on the machine's speed;
# - a number of executions (GWT_FUZZ_RUNS) rather than seconds as the limit;
# - no coverage of LibTorch's and the C++ library's functions by name (fuzz/coverage_ignorelist.txt;
#   their code inlined into gwt's functions still counts): their code branches on addresses;
# - with a seed, libFuzzer's -use_cmp=0: it otherwise takes compared values into its dictionary,
#   and some of gwt's comparisons are of addresses. (A run without a seed keeps that guidance.)
# One thread: executions stay small, and the CPU goes to the fuzzer loop.
fuzz_env=(LANG=C LC_ALL=C PATH=/usr/bin:/bin "ASAN_OPTIONS=$ASAN_OPTIONS"
          "UBSAN_OPTIONS=$UBSAN_OPTIONS" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 MKL_CBWR=COMPATIBLE)
[[ -n "$symbolizer" ]] && fuzz_env+=("ASAN_SYMBOLIZER_PATH=$symbolizer")
grep -qw avx2 /proc/cpuinfo 2>/dev/null && fuzz_env+=(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)
# (A run with notes has one variable more, so it is not the run without them.)
if [[ -n "${GWT_FUZZ_NOTES:-}" ]]; then
  mkdir -p "$GWT_FUZZ_NOTES"
  fuzz_env+=("GWT_FUZZ_NOTES=$(cd "$GWT_FUZZ_NOTES" && pwd)")
fi
# What would keep a seeded run from replaying is said once, before the targets run (a run without
# a seed replays nothing anyway).
replay_warning() { [[ -n "${GWT_FUZZ_SEED:-}" ]] && echo "fuzz: $*; a seed does not replay a run here"; true; }
no_aslr=()
if setarch "$(uname -m)" -R true 2>/dev/null; then
  no_aslr=(setarch "$(uname -m)" -R)
else
  replay_warning "setarch -R is not allowed here: addresses are randomised"
fi
# The same binary, too: with scripts/setup.sh's CCACHE_BASEDIR the compiler sees relative source
# paths, so the binary does not depend on where the clone lies; an object built with absolute
# paths (a build directory older than that setting) puts the clone's path into __FILE__ strings,
# and their lengths move the heap as a path's do.
if [[ -n "${GWT_FUZZ_SEED:-}" ]]; then
  for t in "${targets[@]}"; do
    if grep -qaF "$root/src/" "$build/fuzz/gwt_fuzz_$t"; then
      replay_warning "$build/fuzz/gwt_fuzz_$t holds this clone's path ($root/src/...; remove $build" \
                     "and run again for a build that replays anywhere)"
      break
    fi
  done
fi
# The build directory as the fuzzer is called: relative to the root where it lies inside it.
build_call="$build"
if [[ "$build" == "$root"/* ]]; then
  build_call="${build#"$root"/}"
else
  replay_warning "the build directory lies outside the repository, so the fuzzer is called by its" \
                 "absolute path"
fi
# Runs target $1 with the rest as libFuzzer's arguments, as described above, its stdout and stderr
# to stdout; the shell's own line about a child killed by a signal (abort_on_error's SIGABRT) goes
# nowhere: the log has the report.
fuzzer() {
  local target="$1"; shift
  (cd "$root" && exec env -i "${fuzz_env[@]}" "${no_aslr[@]}" "$build_call/fuzz/gwt_fuzz_$target" "$@") 2>&1
} 2>/dev/null

crashes_dir="$root/fuzz/crashes"
mkdir -p "$crashes_dir"
# The working corpus lives on tmpfs where there is one: libFuzzer takes its seed inputs in the order
# the directory lists them (ties of size stay in that order), and tmpfs lists in the order the files
# were made, which the sorted glob below fixes; ext4 lists in the order of a hash seeded per
# filesystem, so a fixed GWT_FUZZ_SEED would replay other inputs on another disk.
# (Where /dev/shm has under 256 MB free, as in a container's default 64 MB, the disk it is.)
shm_free_kb=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1 | tr -d ' ' || true)
if [[ "${shm_free_kb:-0}" =~ ^[0-9]+$ && "${shm_free_kb:-0}" -ge 262144 ]]; then
  work="$(mktemp -d -p /dev/shm)"
else
  work="$(mktemp -d -p /tmp)"
  replay_warning "/dev/shm has under 256 MB free: the corpus is in $work, a path of another length"
fi
trap 'rm -rf "$work"' EXIT
total_execs=0 total_crashes=0 total_libtorch=0 failed=0
# At most this many LibTorch defects per target before the run counts as failed: the screen in
# fuzz/libtorch_guard.h should make them rare, and many would mean it no longer works.
max_libtorch=3
for t in "${targets[@]}"; do
  corpus="$work/$t"
  mkdir -p "$corpus"
  [[ -d "$root/fuzz/corpus/$t" ]] && cp "$root/fuzz/corpus/$t/"* "$corpus/" 2>/dev/null || true
  seeds=$(find "$corpus" -type f | wc -l)
  t_start=$(date +%s)
  execs=0 crashes=0 libtorch=0 rc=0 part=0 seeds_used=()
  # libFuzzer stops at the first crash (or timeout, or out-of-memory) and exits non-zero. A crash
  # inside LibTorch's archive reader, before any gwt code saw the input (scripts/fuzz_crash_origin.sh
  # says "libtorch"), is reported with its input kept, and the target goes on for the rest of its
  # time on the corpus it has grown, with the next seed; any other crash ends the target, failed.
  while :; do
    part=$((part + 1))
    log="$work/$t.$part.log"
    # The time left, written with as many digits as SECONDS: the arguments' lengths move the heap,
    # so a part after a LibTorch defect replays too.
    left=$seconds
    if [[ $part -gt 1 ]]; then
      left=$((seconds - ($(date +%s) - t_start)))
      [[ $left -ge 1 ]] || break
      printf -v left "%0${#seconds}d" "$left"
    fi
    runs_left=""
    if [[ -n "${GWT_FUZZ_RUNS:-}" ]]; then
      runs_left=$((GWT_FUZZ_RUNS - execs))
      [[ $part -gt 1 && $runs_left -lt 1 ]] && break
    fi
    part_seed=""
    [[ -n "${GWT_FUZZ_SEED:-}" ]] && part_seed=$((GWT_FUZZ_SEED + part - 1))
    rc=0
    fuzzer "$t" -max_total_time="$left" ${runs_left:+-runs=$runs_left} \
      ${part_seed:+-seed=$part_seed -use_cmp=0} -reload=0 \
      -timeout=10 -rss_limit_mb=4096 \
      -print_final_stats=1 -artifact_prefix="fuzz/crashes/$t-" "$corpus" >"$log" || rc=$?
    part_execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
    seeds_used+=("$(sed -n 's/^INFO: Seed: *\([0-9]*\).*/\1/p' "$log" | head -1)")
    execs=$((execs + ${part_execs:-0}))
    grep -h '^gwt fuzz note' "$log" | sed 's/^/  /' || true
    [[ $rc -eq 0 && -n "$part_execs" ]] && break
    input=$(grep -h 'Test unit written to' "$log" | sed 's/.*written to //' | tail -1 || true)
    [[ -n "$input" && "$input" != /* ]] && input="$root/$input"
    # Whose code crashed is read from a replay of the input alone, with the stacks of allocations
    # unwound the slow way: AddressSanitizer's report of an allocation it could not serve carries
    # the stack taken at malloc, which the default fast unwinder cuts at the first library built
    # without frame pointers (LibTorch), too short to tell who called it (measured: two frames,
    # operator new and the unpickler, against 20 in the replay). A replay that does not crash
    # again, or a judge that fails, says gwt.
    origin=gwt
    if [[ $rc -ne 0 && -n "$input" && -f "$input" ]]; then
      (fuzz_env+=("ASAN_OPTIONS=$ASAN_OPTIONS:fast_unwind_on_malloc=0")
       fuzzer "$t" -timeout=10 -rss_limit_mb=4096 -artifact_prefix="$work/replay-" \
        "$input" >"$log.replay") || true
      origin=$("$root/scripts/fuzz_crash_origin.sh" "$log.replay") || origin=gwt
    fi
    if [[ $origin == libtorch && $libtorch -lt $max_libtorch ]]; then
      libtorch=$((libtorch + 1))
      echo "fuzz $t: a LibTorch defect after $execs executions, inside load_from before gwt saw the input" \
           "(scripts/fuzz_crash_origin.sh; not counted as a crash); going on with another seed. Its report:"
      grep -m1 -E 'ERROR: |runtime error: ' "$log.replay" | sed 's/^/  | /' || true
      grep -E '^ *#[0-9]+ 0x[0-9a-f]+ in ' "$log.replay" | grep -m4 -E 'torch::|caffe2::' \
        | sed 's/^/  | /' || true
      echo "  input: $input"
      continue
    fi
    crashes=1
    failed=1
    [[ $origin == libtorch ]] && echo "fuzz $t: a LibTorch defect again, the $((libtorch + 1))th:" \
      "more than $max_libtorch means the screen (fuzz/libtorch_guard.h) has a hole to mend"
    echo "fuzz $t: CRASHED (exit $rc) after $execs executions (seed ${seeds_used[-1]:-?}); log tail" \
         "(of the replay with full allocation stacks, where there is one):"
    report="$log"
    [[ -s "$log.replay" ]] && report="$log.replay"
    tail -40 "$report" | sed 's/^/  | /'
    [[ -n "$input" ]] && echo "  input: $input"
    break
  done
  units=$(find "$corpus" -type f | wc -l)
  if [[ -n "${GWT_FUZZ_LOGS:-}" ]]; then
    mkdir -p "$GWT_FUZZ_LOGS" && cp "$work/$t".*.log* "$GWT_FUZZ_LOGS/"
  fi
  if [[ $crashes -eq 0 ]]; then
    elapsed=$(( $(date +%s) - t_start ))
    [[ ${#seeds_used[@]} -gt 1 ]] && seed_text="seeds ${seeds_used[*]}" || seed_text="seed ${seeds_used[0]:-?}"
    echo "fuzz $t: $execs executions in $elapsed s ($((execs / (elapsed > 0 ? elapsed : 1)))/s," \
         "$seed_text), 0 crashes, $libtorch LibTorch defects, corpus $seeds -> $units inputs"
  fi
  total_execs=$((total_execs + execs))
  total_crashes=$((total_crashes + crashes))
  total_libtorch=$((total_libtorch + libtorch))
  if [[ "${GWT_FUZZ_MERGE:-0}" == 1 && $crashes -eq 0 ]]; then
    mkdir -p "$root/fuzz/corpus/$t"
    fuzzer "$t" -merge=1 "$root/fuzz/corpus/$t" "$corpus" >"$work/$t.merge.log" \
      || { echo "fuzz $t: merge failed"; tail -20 "$work/$t.merge.log"; failed=1; }
  fi
done
echo "fuzz total: ${#targets[@]} targets, $total_execs executions, $total_crashes crashes, $total_libtorch LibTorch defects"
exit "$failed"
