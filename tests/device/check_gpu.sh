#!/usr/bin/env bash
# The GPU check: the CUDA and NCCL paths that CI's machine (no GPU) skips, run on a lent GPU machine.
#
# Run from the repository root, on one NVIDIA GPU (H100 / H200) with python3 holding torch with CUDA,
# numpy, pytest, pytest-timeout, psutil and nvidia-ml-py. No network there: the packages the tests import
# that such a machine lacks travel as wheels in .whl/ (in .git/info/exclude), fetched beforehand on a
# machine with an index by `tests/device/check_gpu.sh --fetch-wheels` (WHEELS below, for CPython 3.12 on
# x86-64 Linux, about 3 MB), and are installed into /tmp/site there. The project runs from the checkout
# (PYTHONPATH), not installed. Writes junit.xml and log.txt under $OUT (default /tmp/vigil-gpu-check).
# --noconftest: the shared conftest files import the controller's database and Ray helpers, which none
# of these tests use; plugins are not auto-loaded (only pytest-timeout is wanted). About a minute on an
# H100; the whole run is capped at 4 minutes.
set -uo pipefail

# What the tests import beyond the GPU image's packages (import-traced): pydantic (vigil.contract.schemas),
# pydantic-settings (vigil.contract.settings) and their requirements. typing-extensions: pydantic-core
# needs a recent one.
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0
        typing-inspection==0.4.5 python-dotenv==1.2.4 typing-extensions==4.16.0)
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  rm -rf .whl && mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
fi

OUT=${OUT:-/tmp/vigil-gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 2; }
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

nvidia-smi -L
python3 - <<'EOF'
import sys, torch, pydantic
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| NCCL", ".".join(map(str, torch.cuda.nccl.version())), "| pydantic", pydantic.__version__)
print("device:", torch.cuda.get_device_name(0), "| GPUs:", torch.cuda.device_count())
EOF

TESTS=(tests/vigil/test_cuda.py tests/vigil/test_cuda_capture.py tests/vigil/test_cuda_optim.py
       tests/device/test_gpu_collector.py)
timeout 240 python3 -m pytest -q -p no:cacheprovider -p pytest_timeout --noconftest -rs --timeout 150 "${TESTS[@]}" \
  --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
