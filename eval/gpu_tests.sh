#!/usr/bin/env bash
# On a GPU machine: every test on CUDA. Kernel tests pick the GPU through their `device` fixture; model, cache and
# generation tests run with HF_BOLE_TEST_DEVICE=cuda (every tensor and model made on the GPU), once on the image's
# transformers and once more on each transformers wheel given as an argument. Logs go to $OUT (default results/).
# Wheels in .whl/ (fla-core) are installed to /tmp/site-fla and put on the path of every test: transformers then
# runs plain decoding's GDN layers through fla, as for a user who installed it (tests that compare with transformers'
# forward at fp32 tolerances switch back to its torch path: the `torch_gdn` fixture).
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
PYTEST="python3 -m pytest -q -p no:cacheprovider -rf --tb=short $XDIST"

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla .whl/*.whl
fi
echo "== kernels (CUDA)"
PYTHONPATH=/tmp/site-fla:$PYTHONPATH $PYTEST tests/kernels 2>&1 | tee "$OUT/gpu_tests_kernels.log" | tail -8

# installed (not only on PYTHONPATH) so that transformers finds custom_generate/requirements.txt's hf-bole
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
echo "== models, cache, generation (CUDA, image transformers)"
PYTHONPATH=/tmp/site-fla:$PYTHONPATH HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/models tests/cache tests/generation 2>&1 \
    | tee "$OUT/gpu_tests_model.log" | tail -25

for wheel in "$@"; do
    site=/tmp/site-$(basename "$wheel" .whl)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
    echo "== models, cache, generation (CUDA, $(basename "$wheel"))"
    PYTHONPATH=$site:$PYTHONPATH HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/models tests/cache tests/generation 2>&1 \
        | tee "$OUT/gpu_tests_model_$(basename "$wheel" .whl).log" | tail -25
done
