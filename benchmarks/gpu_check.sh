#!/usr/bin/env bash
# gpuhub's GPU paths on a machine with an NVIDIA GPU: the device entry point.
#
#   bash benchmarks/gpu_check.sh [gpu_check.py options]
#
# Device run: command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 420. The wheels
# are not in git: first, here, `bash benchmarks/gpu_check.sh --fetch-wheels` downloads them into
# .whl/ (and adds /.whl/ to .git/info/exclude), for the device's Python 3.12 on x86-64.
#
# Installs the carried wheels (.whl/: ipykernel, jupyter_client, ipyparallel, pyzmq, tornado,
# dask, distributed, dask-cuda and their needs; never torch or numpy, which the machine has)
# into /tmp/site (.whl/fallback/: a newer cuda-core, only where the machine's cannot serve
# dask-cuda), shows nvidia-smi, then runs benchmarks/gpu_check.py from the checkout with a
# hard time limit. Everything goes to stdout and to $OUT/log.txt; the table to $OUT/gpu_check.txt
# and the details to $OUT/gpu_check.json. Exit status: gpu_check.py's (1 when a check failed).
set -u -o pipefail
cd "$(dirname "$0")/.."

# What the device lacks (its image has torch, numpy, pandas, psutil, pyyaml, click, cloudpickle,
# msgpack, toolz, jinja2, pygments, tqdm, python-dateutil, nvidia-ml-py, cuda-core ...).
# rapids-dask-dependency also names bokeh, which only the dashboard would use: left out.
WHEELS="dask-cuda==26.10.0 rapids-dask-dependency==26.10.0 dask==2026.7.1 distributed==2026.7.1
zict==3.0.0 tblib==3.2.2 locket==1.0.0 partd==1.4.2 ipyparallel==9.2.0 ipykernel==7.4.0
ipython==9.18.1 jupyter_client==8.10.0 jupyter_core==5.9.1 pyzmq==27.3.0 tornado==6.6.1
traitlets==5.16.1 comm==0.2.3 debugpy==1.8.22 nest-asyncio2==1.7.4 decorator==5.3.1 jedi==0.20.1
parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53
wcwidth==0.9.4 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4
ipython_pygments_lexers==1.1.1 platformdirs==4.14.8"
FALLBACK="cuda-core==1.2.2 cuda-pathfinder==1.9.1"
if [ "${1:-}" = --fetch-wheels ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    get() {
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux1_x86_64 -d "$@"
    }
    # shellcheck disable=SC2086
    get .whl $WHEELS && get .whl/fallback $FALLBACK && du -sh .whl
    exit
fi
export OUT="${OUT:-/tmp/gpu_check_out}"
SITE="${GPUCHECK_SITE:-/tmp/site}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
{
    echo "== $(date -u +%FT%TZ) $(hostname) $(uname -r), $($PY --version 2>&1) at $(command -v "$PY")"
    if compgen -G ".whl/*.whl" >/dev/null; then
        t=$(date +%s)
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || echo "== pip install of the carried wheels FAILED"
        echo "== installed $(ls .whl/*.whl | wc -l) carried wheels into $SITE in $(($(date +%s) - t)) s"
        # dask-cuda needs cuda.core.Device (cuda-core >= 0.5.1); the machine's is used unless too old
        if ! PYTHONPATH="$SITE" "$PY" -c "from cuda.core import Device" 2>/dev/null &&
            compgen -G ".whl/fallback/*.whl" >/dev/null; then
            echo "== cuda.core.Device not importable: installing the carried fallback cuda-core"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$SITE" .whl/fallback/*.whl
        fi
    else
        echo "== no carried wheels in .whl/ (pass carry [\".whl\"])"
    fi
    nvidia-smi || echo "== nvidia-smi failed"
    nvidia-smi topo -m 2>/dev/null
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GPUCHECK_SITE="$SITE"
    timeout -k 15 360 "$PY" benchmarks/gpu_check.py "$@"
    rc=$?
    echo "== gpu_check.py exited $rc"
    exit $rc
} 2>&1 | tee "$OUT/log.txt"
