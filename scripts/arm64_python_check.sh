#!/usr/bin/env bash
# scripts/arm64_python_check.sh -- the Python-level ARM check, run by hand (not in CI).
#
# Builds mxfp4x from this checkout inside an arm64 Debian root run through QEMU
# user-mode emulation, with an aarch64 CPU build of torch, and runs a subset of the
# test suite there (decode, moe, dispatch, threads) on the NEON kernels:
#
#   1. debootstrap --arch=arm64 a minimal Debian root (first stage on the host, second
#      stage inside it through qemu-aarch64-static + binfmt_misc);
#   2. python3 -m venv, pip install torch==$TORCH_VERSION (CPU index), numpy, cython,
#      pytest, hypothesis; pip install -e . of a copy of the working tree;
#   3. pytest tests/kernels/test_decode.py tests/api/test_moe.py tests/kernels/test_dispatch.py
#      tests/determinism/test_threads.py, with backend_info() printed first (isa must be "neon",
#      threads "pthreads": torch's aarch64 wheels vendor their own libgomp).
#
# Usage (root; a Debian/Ubuntu host with network access):
#   sudo scripts/arm64_python_check.sh            # root in /var/tmp/mxfp4x-arm64, reused
#   MXFP4X_ARM64_ROOT=/path TORCH_VERSION=2.9.1 SUITE=bookworm scripts/arm64_python_check.sh
#   PYTEST_ARGS="-x -k neon" scripts/arm64_python_check.sh
# Expect tens of minutes: everything inside the root runs emulated (torch's import alone
# takes tens of seconds).  The C-level NEON checks (tests/kernels/test_c_kernels.py) are the fast
# proof and run in CI; this script adds the Cython driver, OpenMP and torch on aarch64.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKOUT="$PWD"
ROOT="${MXFP4X_ARM64_ROOT:-/var/tmp/mxfp4x-arm64}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
TORCH_VERSION="${TORCH_VERSION:-2.9.1}"
# PyPI's aarch64 torch wheels are CPU builds; TORCH_INDEX may name another index
TORCH_INDEX="${TORCH_INDEX:-}"
PYTEST_ARGS="${PYTEST_ARGS:-}"

[ "$(id -u)" = 0 ] || { echo "arm64_python_check: needs root (debootstrap, chroot)" >&2; exit 2; }
need() { command -v "$1" >/dev/null 2>&1 || apt-get install -y -q "$2"; }
need debootstrap debootstrap
need qemu-aarch64-static qemu-user-static
# the kernel must hand aarch64 executables to QEMU, inside the chroot too (flag F)
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    need update-binfmts binfmt-support
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    update-binfmts --enable qemu-aarch64
fi

SECONDS=0
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    echo "== debootstrap $SUITE arm64 into $ROOT"
    debootstrap --arch=arm64 --foreign --variant=minbase \
        --include=python3,python3-venv,python3-dev,gcc,libc6-dev,ca-certificates \
        "$SUITE" "$ROOT" "$MIRROR"
    cp "$(command -v qemu-aarch64-static)" "$ROOT/usr/bin/"
    chroot "$ROOT" /debootstrap/debootstrap --second-stage
fi
echo "== root ready after ${SECONDS}s"

mounted=()
cleanup() { for m in "${mounted[@]}"; do umount -l "$m" || true; done; }
trap cleanup EXIT
for m in proc sys dev; do
    mountpoint -q "$ROOT/$m" || { mount --rbind "/$m" "$ROOT/$m"; mounted+=("$ROOT/$m"); }
done
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# the host's CA bundle (a network that re-signs TLS needs its CA inside the root too)
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/host-ca-certificates.crt"

# the working tree (tracked and untracked, not ignored), without build outputs
rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
git -C "$CHECKOUT" ls-files -z --cached --others --exclude-standard \
    | (cd "$CHECKOUT" && tar --null -T - -cf -) | tar -xf - -C "$ROOT/src"

chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin \
    PIP_CERT=/etc/ssl/certs/host-ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/host-ca-certificates.crt PIP_DEFAULT_TIMEOUT=180 \
    TORCH_VERSION="$TORCH_VERSION" TORCH_INDEX="$TORCH_INDEX" PYTEST_ARGS="$PYTEST_ARGS" \
    /bin/bash -euo pipefail -c '
cd /src
[ -x /venv/bin/python ] || python3 -m venv /venv
. /venv/bin/activate
SECONDS=0
pip install -q --upgrade pip
pip install -q "torch==$TORCH_VERSION" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
pip install -q numpy "cython>=3.0" "setuptools>=77" pytest hypothesis
echo "== python deps after ${SECONDS}s"
pip install -q --no-build-isolation -e .
echo "== mxfp4x built after ${SECONDS}s"
python -c "import json, mxfp4x; i = mxfp4x.backend_info(); print(json.dumps(i)); \
assert i[\"isa\"] == \"neon\", i"
MXFP4X_REQUIRE_OPENMP=0 MXFP4X_REQUIRE_THREADS=pthreads pytest -q -p no:cacheprovider $PYTEST_ARGS tests/kernels/test_decode.py \
    tests/api/test_moe.py tests/kernels/test_dispatch.py tests/determinism/test_threads.py
echo "== tests done after ${SECONDS}s"
'
echo "== arm64_python_check: done in ${SECONDS}s"
