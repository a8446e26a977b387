python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
timeout 250 python3 -m pytest -q -rf -p no:cacheprovider --durations=10 tests/test_gpu_decode.py tests/test_gpu_backward.py tests/test_gpu_backward_lineage.py tests/test_gpu_emulator_parity.py > $OUT/new.txt 2>&1; echo "new rc $?"
tail -40 $OUT/new.txt | cut -c1-300
timeout 300 python3 -m pytest -q -rf -p no:cacheprovider -m gpu --durations=10 --deselect tests/test_gpu_decode.py --deselect tests/test_gpu_backward.py --deselect tests/test_gpu_backward_lineage.py --deselect tests/test_gpu_emulator_parity.py > $OUT/rest.txt 2>&1; echo "rest rc $?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/rest.txt | head -40 | cut -c1-300
