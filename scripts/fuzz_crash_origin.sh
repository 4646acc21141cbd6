#!/usr/bin/env bash
# Says whose code a libFuzzer crash report is in: "libtorch" or "gwt".
#
#   scripts/fuzz_crash_origin.sh LOG
#
# "libtorch": the report's stack (the first one after its last "ERROR:" or "runtime error:" line)
# runs through torch::serialize::InputArchive::load_from, called straight from the harness's
# gwt_fuzz::read_archive (fuzz/libtorch_guard.h), with no gwt or gwt_fuzz function between the
# crashing frame and load_from. Such a crash happened inside LibTorch's archive reader, on bytes
# that no gwt code had yet seen (gwt's load() receives the InputArchive that load_from built): a
# LibTorch defect the harness's screen did not foresee, as README "Reliability" describes.
# Everything else is "gwt": any gwt frame under load_from, a report without a stack, a crash
# anywhere else (gwt's code, the harness, LibTorch called from gwt's code).
set -euo pipefail
[[ $# -eq 1 && -r "$1" ]] || { echo "usage: scripts/fuzz_crash_origin.sh LOG" >&2; exit 2; }

awk '
  # Frames of the stack that follows the last error line, as function names (the text after
  # " in " up to the argument list).
  /ERROR: |runtime error: / { n = 0; in_stack = 0; collecting = 1; next }
  # Frame lines as the sanitizers print them ("    #3 0x55d0 in name(args) file:line"), also
  # with the "  | " that scripts/fuzz.sh puts before a quoted log.
  collecting && /^[ |]*#[0-9]+ 0x[0-9a-f]+ in / {
    line = $0
    sub(/^[ |]*#[0-9]+ 0x[0-9a-f]+ in /, "", line)
    paren = index(line, "(")
    name = paren > 0 ? substr(line, 1, paren - 1) : line
    frames[n++] = name
    in_stack = 1
    next
  }
  collecting && in_stack { collecting = 0 }
  END {
    verdict = "gwt"
    seen_load = 0
    for (i = 0; i < n; ++i) {
      f = frames[i]
      if (f ~ /torch::serialize::InputArchive::load_from/) { seen_load = 1; continue }
      if (!seen_load) {
        if (f ~ /(^|[^A-Za-z0-9_])gwt(_fuzz)?::/ || f ~ /LLVMFuzzerTestOneInput/) break
        continue
      }
      # The first frame above load_from: the harness reading the archive, nothing else.
      if (f ~ /^gwt_fuzz::read_archive/) verdict = "libtorch"
      break
    }
    print verdict
  }
' "$1"
