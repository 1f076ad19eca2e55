#!/usr/bin/env bash
# Run the test suite under another torch version, in a venv of its own (.venv-torch-<version>), with its
# own kernel cache. torch_xla pins torch 2.9, so its tests skip themselves (with that reason); the rest
# runs, the compiler path (tests/compiler, test_accelerate) included:
#
#     bash tools/test_torch.sh 2.13.0+cpu [pytest args...]     (or: make test-torch TORCH=2.13.0+cpu)
#
# pytest args replace the default target `tests` (name the test paths with them, e.g. tests/compiler -x).
#
# A CUDA build of torch from PyPI (2.11.0, 2.12.1, ...) runs on a CPU-only machine as well. torchvision,
# the reference of the nms and dcn_v2 tests, is installed in the version that matches torch (0.<minor+15>);
# where none loads (torch's +cpu builds, for which PyPI has only CUDA builds of torchvision) those two
# test files are left out, and the script says so.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: tools/test_torch.sh <torch version> [pytest args...]}"
shift
venv=".venv-torch-$version"
py="$venv/bin/python"
test -x "$py" || "${PYTHON:-python3.11}" -m venv "$venv"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "torch==$version" numpy pytest pybind11 ninja tqdm transformers peft matplotlib \
  ensemble-boxes ruff
minor=$(echo "$version" | cut -d. -f2)
ignore=()
if ! { "$py" -m pip install --quiet --no-deps "torchvision==0.$((minor + 15)).*" \
       && "$py" -c "import torchvision.ops; torchvision.ops.nms" >/dev/null 2>&1; }; then
  "$py" -m pip uninstall --quiet --yes torchvision >/dev/null 2>&1 || true
  echo "test_torch: no torchvision loads with torch $version: tests/runtime/test_nms.py and test_dcn_v2.py left out" >&2
  ignore=(--ignore=tests/runtime/test_nms.py --ignore=tests/runtime/test_dcn_v2.py)
fi
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
export ACCEL_EXT_DIR="${ACCEL_EXT_DIR:-$HOME/.cache/accel/ext}"  # builds are kept apart by torch version
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -q -p no:logging "${ignore[@]}" "${@:-tests}"
