#!/usr/bin/env python3
"""No AVX code where the linker may hand it to a CPU without AVX2.

The AVX2 builds of the CPU kernels (src/kernels/avx2/*_avx2.cpp) may define only two kinds of functions
that other object files can see: gwt's own, in namespace gwt::kernels::avx2, which no other file
defines and which run only after the dispatch saw AVX2; and copies of functions other files
share (inline and template functions of the standard library, c10, ATen, gwt's public headers),
which must then hold no AVX instruction: the linker keeps one copy of each for every caller, and
it may be this one (src/kernels/avx2/avx2_target.h).

Checked on the objects of the build given (as configured), and on the same files compiled again
without optimisation, where the compiler leaves most inline functions out of line: before
avx2_target.h, such a build of the files with -mavx2 left 38 out-of-line copies (17 + 21 in the two
files) of such functions with AVX instructions in them: c10's float16 and bfloat16 conversions,
std::sqrt(float), std::isnan(float), std::fill's loops. Run by ctest on the GCC build and by
scripts/fuzz.sh on its clang build (clang's pragma is another one).

    tests/isa_check.py BUILD_DIR     (needs compile_commands.json there, nm, objdump, c++filt)
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

# gwt's own functions of the AVX2 builds, members and lambdas included (mangled: the demangled form
# of a template starts with its return type).
OWN = re.compile(r"_ZZ?NK?3gwt7kernels4avx2")
# A VEX- or EVEX-encoded instruction (AVX, AVX2, FMA, F16C: every mnemonic starts with v), or an
# operand only they have.
AVX = re.compile(r"^v[a-z]|%[yz]mm")


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def shared_functions(obj):
    """The functions obj defines with global or weak binding (mangled names)."""
    out = []
    for line in run(["nm", "--defined-only", "--format=posix", obj]).splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1] in ("T", "W", "i"):
            out.append(parts[0])
    return out


def avx_instructions(obj):
    """AVX instructions per function symbol of obj (one disassembly of the whole object)."""
    counts, current = {}, None
    text = run(["objdump", "-d", "--no-show-raw-insn", obj])
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            current = head.group(1)
            counts.setdefault(current, 0)
            continue
        fields = line.split("\t")
        if current is not None and len(fields) >= 2 and AVX.search(fields[1].strip()):
            counts[current] += 1
    return counts


def check(obj, label):
    functions = [m for m in shared_functions(obj) if not OWN.match(m)]
    counts = avx_instructions(obj)
    offenders = [m for m in functions if counts.get(m, 0)]
    names = run(["c++filt"], input="\n".join(offenders)).splitlines() if offenders else []
    bad = [f"{label}: {name} ({counts[m]} AVX instructions)" for m, name in zip(offenders, names)]
    # Not a check of nothing: gwt's own functions there must hold AVX code (else the pragma did not
    # apply, the object is not machine code (LTO), or objdump's output was not understood).
    own = sum(n for symbol, n in counts.items() if OWN.match(symbol))
    if own == 0:
        bad.append(f"{label}: no AVX instruction in gwt::kernels::avx2 either: nothing was checked")
    print(f"isa_check: {label}: {len(functions)} functions other files may share, {len(offenders)} with "
          f"AVX code; {own} AVX instructions in gwt::kernels::avx2")
    return bad


def arguments(entry):
    return entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])


def output(entry):
    """The object file entry's command writes."""
    args = arguments(entry)
    obj = entry.get("output") or next(
        (b for a, b in zip(args, args[1:]) if a == "-o"), None)
    return obj if obj is None or os.path.isabs(obj) else os.path.join(entry["directory"], obj)


def unoptimised(entry, out):
    """The compile command of entry with -O0 and its output at out."""
    args = arguments(entry)
    keep, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = 1
            continue
        if a in ("-MD", "-MMD") or re.fullmatch(r"-O([0-3sgz]|fast)?", a):
            continue
        keep.append(a)
    return keep + ["-O0", "-o", out]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build = sys.argv[1]
    db = os.path.join(build, "compile_commands.json")
    entries = [e for e in json.load(open(db))
               if re.search(r"src/kernels/avx2/[a-z_]+_avx2\.cpp$", e["file"])]
    if not entries:
        print(f"isa_check: no src/kernels/avx2/*_avx2.cpp in {db} (an x86-64 build has two)")
        return 1
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for e in entries:
            name = os.path.basename(e["file"])
            obj = output(e)
            if obj is None or not os.path.exists(obj):
                print(f"isa_check: {name}: no object built (run the build first)")
                return 1
            bad += check(obj, f"{name} as built")
            o0 = os.path.join(tmp, name + ".O0.o")
            subprocess.run(unoptimised(e, o0), check=True, cwd=e["directory"])
            bad += check(o0, f"{name} at -O0")
    for b in bad:
        print("isa_check: FAIL", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
