"""Put on PYTHONPATH by tests/run/test_merge.py for one load share: with KVBENCH_TEST_CLOCK_SKEW_S set, this
process's ``time.perf_counter`` reads that many seconds ahead from its start on, as a process on a machine
with another clock would (kvbench's stamps all come from it)."""
import os
import time

if os.environ.get("KVBENCH_TEST_CLOCK_SKEW_S"):
    _skew = float(os.environ["KVBENCH_TEST_CLOCK_SKEW_S"])
    _real = time.perf_counter
    time.perf_counter = lambda: _real() + _skew
