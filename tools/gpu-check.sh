#!/usr/bin/env bash
# bitcomm's GPU checks in one command, for a lent CUDA machine: the CUDA tests and the GPU
# benchmarks, each step under its share of one deadline, everything written under one folder.
#
#   tools/gpu-check.sh OUT [STEP...]
#
# STEP is any of: tests codecs collectives select hooks profile tune (default: all of them, in
# that order; the tests come first because they compile the kernels the benchmarks then find
# cached, and tune, which compiles each kernel again at its neighbouring tiles and warps, last).
#
# The tests step may take 420 s: it compiles every kernel changed since the carried Triton cache
# (some 240 s of a day's changes on an H200, in one process) before its own 66 s; with
# pytest-xdist carried, its processes compile side by side.
#
# Why a script: a lent machine is held for minutes of a fixed budget, starts bare and cannot
# reach a package index. So the packages its image lacks travel as wheels (`make gpu-wheels`
# here puts bitarray, mpich, mpi4py, pytest-xdist and pytest-timeout in .whl/; name .whl in
# the call's carry), the commands are the ones the docs quote, and a step that hangs or fails
# is cut off or reported and the next one runs.
#
# Environment:
#   GPU_CHECK_SECONDS  the deadline for all steps together (default 480); a step gets at most
#                      its own cap and what is left of the deadline, and is skipped when under
#                      30 s is left.
#   GPU_CHECK_PYTHON   the Python that holds a CUDA torch (default python3).
#   GPU_CHECK_WORKERS  processes of the tests step (default 8; 1: one process, no xdist).
#   GPU_CHECK_CODECS_RUNS  how many times the codecs step runs its benchmark (default 2), each
#                      run's files in codecs-run1/, codecs-run2/, ...: a target is judged on
#                      every run, and at 64M elements a host-bound call's ratio moves from
#                      run to run with the host's speed. `bench tally` then counts, row by
#                      row, the runs that met each target (tally.md), and gives the host probe
#                      (the host's speed) and the scheduler's preemptions and CPU moves of
#                      each row that missed.
#   GPU_CHECK_CODECS_PIN  a CPU list as taskset -c takes it (3, 2-3, 1,5): the even-numbered
#                      codecs runs (2, 4, ...) run on those CPUs alone, the odd ones where
#                      the scheduler puts them, so that one call tells whether a host-bound
#                      row misses less when its thread is not moved between CPUs (each
#                      run's rows record its moves; a pinned run's heading names its CPUs).
#   GPU_CHECK_WHEELS   the folder of carried wheels (default .whl in the checkout). The
#                      triton-cache.tgz.part-* files there (the ones an earlier run left in
#                      OUT), or one whole triton-cache.tgz, are unpacked into Triton's cache
#                      first: a fresh machine then compiles only the kernels changed since
#                      (on an H200, a cache without a day's changed kernels made test_cuda
#                      take over 300 s where it takes 66 s with them).
#
# Writes OUT/gpu-check.log (each step's command, output, exit status and seconds),
# OUT/gpu-check.tar.gz (the benchmarks' .json/.csv/.md files, the tests' junit XML, and
# gpu-clocks.csv and vmstat.log where nvidia-smi and vmstat are there) and
# OUT/triton-cache.tgz.part-aa, -ab, ... (the compiled kernels, for the next run, in parts of
# 15 MiB: a lent machine hands back at most 8 files of 16 MiB each, and the whole cache is
# larger). Exits 1 if a step failed or was cut off.
set -uo pipefail

usage() {
    echo "usage: $0 OUT [tests|codecs|collectives|select|hooks|profile|tune ...]" >&2
    exit 2
}
[ $# -ge 1 ] || usage
out=$1
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests codecs collectives select hooks profile tune)
for s in "${steps[@]}"; do
    case $s in tests|codecs|collectives|select|hooks|profile|tune) ;; *) echo "unknown step: $s" >&2; usage ;; esac
done
nworkers=${GPU_CHECK_WORKERS:-8}
case $nworkers in
    '' | *[!0-9]*) echo "GPU_CHECK_WORKERS: expected a whole number, got '$nworkers'" >&2; usage ;;
esac
nruns=${GPU_CHECK_CODECS_RUNS:-2}
case $nruns in
    '' | *[!0-9]* | 0) echo "GPU_CHECK_CODECS_RUNS: expected a whole number >= 1, got '$nruns'" >&2
        usage ;;
esac

pin=${GPU_CHECK_CODECS_PIN:-}
if [ -n "$pin" ] && ! [[ $pin =~ ^[0-9]+([,-][0-9]+)*$ ]]; then
    echo "GPU_CHECK_CODECS_PIN: expected a CPU list as taskset -c takes (3, 2-3, 1,5), got '$pin'" >&2
    usage
fi

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
log=$out/gpu-check.log
work=$(mktemp -d)
monitors=()
trap '[ ${#monitors[@]} -eq 0 ] || kill "${monitors[@]}" 2> /dev/null; rm -rf "$work"' EXIT
py=${GPU_CHECK_PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-$root/.whl}
deadline=${GPU_CHECK_SECONDS:-480}
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
status=0

say() { echo "$*" | tee -a "$log"; }

# The carried wheels go into a folder of their own on PYTHONPATH (the image's environment is
# left as it is). bitcomm's MPI launcher runs the mpiexec next to the running Python, and
# MPICH's mpiexec needs its hydra_pmi_proxy beside it, so the wheel's programs are linked into
# that Python's folder (only names not already there).
setup() {
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    # the parts in name order are the one archive; a whole triton-cache.tgz is taken as well
    local parts=("$wheels"/triton-cache.tgz.part-*)
    [ -f "${parts[0]}" ] || parts=("$wheels"/triton-cache.tgz)
    if [ -f "${parts[0]}" ]; then
        mkdir -p "$cache" && cat "${parts[@]}" | tar -xzf - -C "$cache" >> "$log" 2>&1 \
            && say "# triton cache restored into $cache from ${parts[*]}"
    fi
    if compgen -G "$wheels/*.whl" > /dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/bitcomm-site "$wheels"/*.whl >> "$log" 2>&1 || return 1
        export PYTHONPATH="/tmp/bitcomm-site:$PYTHONPATH"
        local bin
        bin=$(dirname "$("$py" -c 'import sys; print(sys.executable)')") || return 1
        say "# wheels installed in /tmp/bitcomm-site; their programs linked into $bin"
        for f in /tmp/bitcomm-site/bin/*; do
            [ -e "$f" ] && [ ! -e "$bin/$(basename "$f")" ] && ln -s "$f" "$bin/"
        done
    else
        say "# no wheels in $wheels: using the image's packages"
    fi
    "$py" - >> "$log" 2>&1 <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
if not torch.cuda.is_available():  # every step would skip or refuse: say so once
    sys.exit("no CUDA device: these are the GPU checks")
for name in ("triton", "bitarray", "mpi4py", "numba"):
    try:
        print(name, __import__(name).__version__)
    except ImportError as e:
        print(name, "missing:", e)
EOF
}

# step NAME CAP COMMAND...: run COMMAND under min(CAP, what is left of the deadline).
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((deadline - SECONDS))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 30 ]; then
        say "## $name: skipped, ${left}s left of the ${deadline}s deadline"
        status=1
        return
    fi
    say "## $name (at most ${limit}s): $*"
    local start=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        say "## $name: cut off after $((SECONDS - start))s"
        status=1
    elif [ $rc -ne 0 ]; then
        say "## $name: failed (exit $rc) after $((SECONDS - start))s"
        status=1
    else
        say "## $name: ok in $((SECONDS - start))s"
    fi
}

: > "$log"
say "# bitcomm gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), steps: ${steps[*]}"
nvidia-smi -L >> "$log" 2>&1 || say "# nvidia-smi: not found or failed"
if ! setup; then
    say "## setup: failed (see above: the carried wheels did not install, or no CUDA device)"
    exit 1
fi

# The GPU's clocks and the host's load through every step, beside the results: a slow run can
# then be told from a throttled GPU (its clock-event reasons) or a busy host.
if command -v nvidia-smi > /dev/null 2>&1; then
    fields=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
    nvidia-smi --query-gpu="$fields,clocks_throttle_reasons.active" --format=csv -lms 500 \
        > "$work/gpu-clocks.csv" 2>&1 &
    monitors+=($!)
    say "# GPU clocks every 0.5 s into gpu-clocks.csv (pid $!)"
fi
if command -v vmstat > /dev/null 2>&1; then
    vmstat -t 1 > "$work/vmstat.log" 2>&1 &
    monitors+=($!)
    say "# host load every 1 s into vmstat.log (pid $!)"
fi

cli=("$py" -m bitcomm.cli)
# The CUDA tests in GPU_CHECK_WORKERS processes where pytest-xdist is there (the dev extra;
# `make gpu-wheels` carries it): Triton compiles a process's kernels one after another, and
# compiling is most of a first run's time, on a machine with 16 cores.
workers=()
if [[ " ${steps[*]} " == *" tests "* ]] && [ "$nworkers" -gt 1 ]; then
    if "$py" -c "import xdist" > /dev/null 2>&1; then
        workers=(-n "$nworkers")
        say "# the CUDA tests run in $nworkers processes (pytest-xdist)"
    else
        say "# the CUDA tests run in one process: pytest-xdist is not installed (make gpu-wheels)"
    fi
fi
for s in "${steps[@]}"; do
    case $s in
        tests) step tests 420 "$py" -m pytest "${workers[@]}" -v -rfEs -p no:cacheprovider \
            --junitxml="$work/test_cuda.xml" tests/test_cuda.py ;;
        codecs)
            done_runs=()
            if [ -n "$pin" ] && ! command -v taskset > /dev/null 2>&1; then
                say "# GPU_CHECK_CODECS_PIN: taskset is not here, so no run is pinned"
                pin=
            fi
            for ((run = 1; run <= nruns; run++)); do
                pinned=()
                [ -n "$pin" ] && [ $((run % 2)) -eq 0 ] && pinned=(taskset -c "$pin")
                step "codecs $run" 90 "${pinned[@]}" "${cli[@]}" bench codecs --device cuda \
                    --sizes 64M,256M --repeat 10 --out "$work/codecs-run$run"
                [ -e "$work/codecs-run$run/codecs-cuda.json" ] \
                    && done_runs+=("$work/codecs-run$run")
            done
            # every target against every finished run: runs met, spread, misses (tally.md)
            if [ ${#done_runs[@]} -gt 0 ]; then
                step "codecs tally" 30 "${cli[@]}" bench tally "${done_runs[@]}" --out "$work"
            fi ;;
        collectives) step collectives 120 "${cli[@]}" bench collectives --device cuda \
            --ranks 8 --sizes 64M --repeat 10 --link-gbps 100 --out "$work" ;;
        select) step select 120 "${cli[@]}" bench select --device cuda --sizes 25600K \
            --dists laplace,gauss --out "$work" ;;
        hooks) step hooks 180 "${cli[@]}" bench hooks --transport nccl --ranks 1 \
            --out "$work" ;;
        profile)
            step profile 120 "${cli[@]}" bench profile --device cuda --sizes 64M \
                --host-functions 6 --out "$work"
            # the top-k's and RedSync's calls again without the launch and call replays
            # (BITCOMM_PLANS=0): what the replays save of this machine's host time
            step "profile without replays" 60 env BITCOMM_PLANS=0 "${cli[@]}" bench profile \
                --device cuda --sizes 64M --codecs topk-1%,redsync-1% --host-functions 6 \
                --out "$work/no-replays"
            # their count pass with three tiles' loads in flight (COUNT_STAGES): against the
            # first run's count_at_least rows
            step "profile, count pass pipelined" 60 "${cli[@]}" bench profile --device cuda \
                --sizes 64M --codecs topk-1%,redsync-1% --set COUNT_STAGES=3 \
                --out "$work/count-stages3" ;;
        # rewrites its files after each row: a cut-off run keeps the settings it reached
        tune) step tune 300 "${cli[@]}" bench tune --n 64M --out "$work" ;;
    esac
done

if [ ${#monitors[@]} -gt 0 ]; then
    kill "${monitors[@]}" 2> /dev/null
    wait "${monitors[@]}" 2> /dev/null
    monitors=()
fi
tar -czf "$out/gpu-check.tar.gz" -C "$work" . 2>> "$log"
[ -d "$cache" ] && tar -czf - -C "$cache" . 2>> "$log" \
    | split -b 15M - "$out/triton-cache.tgz.part-" 2>> "$log"
say "# done in ${SECONDS}s; results: $(cd "$work" && find . -type f | sort | tr '\n' ' ')"
exit $status
