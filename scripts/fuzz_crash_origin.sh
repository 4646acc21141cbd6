#!/usr/bin/env bash
# Says whose code a libFuzzer crash report is in: "libtorch" or "gwt".
#
#   scripts/fuzz_crash_origin.sh LOG
#
# "libtorch": the crash stack (the first stack after the report's last "ERROR:" or "runtime
# error:" line) runs through torch::serialize::InputArchive::load_from, called by the harness's
# gwt_fuzz::read_archive (fuzz/libtorch_guard.h) straight from LLVMFuzzerTestOneInput, and every
# frame beneath load_from is named and belongs to LibTorch, the C++ library or the sanitizer and
# fuzzer runtimes (an allow-list of name prefixes). Such a crash happened inside LibTorch's archive
# reader, on bytes that no gwt code had yet seen (gwt's load() receives the InputArchive that
# load_from built): a LibTorch defect the harness's screen did not foresee, as docs/reliability.md
# ("Fuzzing") describes.
#
# Everything else is "gwt", the verdict that fails a run: any frame beneath load_from that is gwt's,
# in an anonymous namespace or unnamed; a report without a stack; an out-of-memory on the RSS limit
# (libFuzzer then prints where the largest live allocations were made, not what was running); a
# crash anywhere else (the code of gwt. the harness, LibTorch called from gwt's code).
set -euo pipefail
[[ $# -eq 1 && -r "$1" ]] || { echo "usage: scripts/fuzz_crash_origin.sh LOG" >&2; exit 2; }

awk '
  # A frame line as the sanitizers print it: "    #3 0x55d0 in name(args) file:line", or without
  # " in name" where there is no symbol; also with the "  | " that scripts/fuzz.sh puts before a
  # quoted log. The frame is the whole signature of its function, what follows " in " up to the module
  # or source path ("operator new(unsigned long) (/bin+0x1)", "LLVMFuzzerTestOneInput /x.cpp:9:3");
  # "?" where there is none. Template arguments stay: the std::function handler of a gwt functor is
  # the code of gwt.
  function frame_name(line,    cut) {
    if (line !~ /^[ |]*#[0-9]+ 0x[0-9a-fA-F]+ in /) return "?"
    sub(/^[ |]*#[0-9]+ 0x[0-9a-fA-F]+ in /, "", line)
    cut = index(line, " (/")
    if (cut > 0) line = substr(line, 1, cut - 1)
    cut = index(line, " /")
    if (cut > 0) line = substr(line, 1, cut - 1)
    sub(/ +$/, "", line)
    return line == "" ? "?" : line
  }
  function starts(frame, prefix) { return index(frame, prefix) == 1 }
  # Whether a frame beneath load_from is LibTorch, the C++ library or a runtime: its name starts
  # with one of these (a name printed with its return type first is not allowed: the safe side).
  function allowed(name) {
    return name ~ /^(torch::|c10::|at::|caffe2::|std::|__gnu_cxx::|__cxxabiv1::|operator (new|delete)|mz_|tdefl_|tinfl_|(__interceptor_|__libc_)?(malloc|calloc|realloc|free|posix_memalign|memalign|aligned_alloc|memcpy|memmove|memset)[( ]|__asan|__sanitizer|__lsan|__ubsan|fuzzer::|raise[( ]|abort[( ]|gsignal[( ])/
  }
  /ERROR: |runtime error: / {
    n = 0; in_stack = 0; collecting = 1
    rss = ($0 ~ /out-of-memory \(used:/)
    next
  }
  collecting && /^[ |]*#[0-9]+ 0x/ { frames[n++] = frame_name($0); in_stack = 1; next }
  collecting && in_stack { collecting = 0 }
  END {
    verdict = "gwt"
    load = "torch::serialize::InputArchive::load_from("
    i = 0
    if (!rss) {
      # Beneath load_from: only allowed frames, with nothing of gwt anywhere in their signature.
      while (i < n && !starts(frames[i], load) && frames[i] !~ /(^|[^A-Za-z0-9_])gwt(_fuzz)?::/ &&
             allowed(frames[i]))
        ++i
      # Then load_from, the harness and its caller.
      if (i + 2 < n && starts(frames[i], load) && starts(frames[i + 1], "gwt_fuzz::read_archive(") &&
          frames[i + 2] == "LLVMFuzzerTestOneInput")
        verdict = "libtorch"
    }
    print verdict
  }
' "$1"
