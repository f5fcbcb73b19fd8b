#!/bin/bash
# One call on the GPU machine (the `run` tool): the Triton tests compiled on the GPU, then the
# full-size synthetic benchmark. Carries .whl (gguf) and optionally .tcache (a Triton cache).
# Reads RUN_TESTS, TESTS, TEST_TIMEOUT, XDIST, RUN_BENCH, BENCH_ARGS, BUDGET, BENCH_TIMEOUT, EXTRA,
# TCACHE=0 (no Triton cache back). Past 8 files (the run tool's limit) the results come back as
# results.tgz.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
if [ -f .tcache/cache.tar.xz ]; then mkdir -p ~/.triton && tar xJf .tcache/cache.tar.xz -C ~/.triton; fi
mkdir -p $OUT/results
if [ "${RUN_TESTS:-1}" = 1 ]; then
  # every test that runs Triton kernels: compiled on the GPU here, interpreted in CI (of the drawn
  # configurations, the Triton cases: the transformers comparison needs CI's transformers)
  TRITON_PROPS="tests/test_config_props.py::test_triton_matches_reference_on_drawn_configs
    tests/test_config_props.py::test_triton_found_configs"
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -x -n ${XDIST:-8} -p no:cacheprovider \
    ${TESTS:-tests/test_triton_*.py tests/test_type_matrix.py tests/test_rules.py $TRITON_PROPS} \
    2>&1 | tail -${TEST_TAIL:-40} | tee $OUT/results/tests.log
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-330} python3 bench/triton/bench_full.py --out $OUT/results --budget ${BUDGET:-250} ${BENCH_ARGS:-} 2>&1 | tee $OUT/results/bench.log
fi

if [ -n "${EXTRA:-}" ]; then eval "$EXTRA"; fi
if [ "${TCACHE:-1}" = 1 ]; then  # the Triton cache back, for .tcache/ next time
  tar cf - -C ~/.triton cache 2>/dev/null | xz -1 -T8 > $OUT/tcache.tar.xz; ls -la $OUT/tcache.tar.xz
fi
# the run tool brings back at most 8 files: past that, the results as one archive
if [ "$(find $OUT -type f | wc -l)" -gt 8 ]; then
  tar czf $OUT/results.tgz -C $OUT results && rm -rf $OUT/results && echo "results packed: $OUT/results.tgz"
fi
