"""Stands in for backends/hf/scripts/gpu_probe.py in tests: the same events, no torch. The bytes it "holds" on the
GPU go to the file $FAKE_GPU_STATE ("pid bytes"), which the fake NVML of the test reads."""
import json
import os
import sys

STATE = os.environ["FAKE_GPU_STATE"]
CONTEXT = 500 * 2**20  # a CUDA context: NVML sees it, the allocator does not
BYTES_PER_TOKEN = int(os.environ.get("FAKE_BYTES_PER_TOKEN", "256"))
SLACK = int(os.environ.get("FAKE_NVML_SLACK", str(2 * 2**20)))  # segment rounding NVML sees on top
allocated = 0


def hold(gpu_bytes: int):
    with open(STATE + ".tmp", "w") as f:  # replaced whole: NVML never reads a device half-way through a change
        f.write(f"{os.getpid()} {CONTEXT + gpu_bytes}")
    os.replace(STATE + ".tmp", STATE)


def emit(event, wait=True, **fields):
    print(json.dumps({"event": event, **fields}), flush=True)
    if wait and sys.stdin.readline().strip() in ("", "stop"):
        sys.exit(0)


def alloc(n):
    hold(0)
    emit("ready", allocated=0, reserved=0, max_allocated=0)
    hold(n)
    emit("allocated", requested=n, allocated=n, reserved=n, max_allocated=n)
    hold(0)
    emit("freed", allocated=0, reserved=0, max_allocated=n)
    emit("done", wait=False)


def kv(cells, new):
    weights = 100 * 2**20
    hold(0)
    emit("ready", allocated=0, reserved=0, max_allocated=0)
    hold(weights)
    emit("loaded", allocated=weights, reserved=weights, max_allocated=weights)
    for cell in cells.split(","):
        prompt, batch = (int(x) for x in cell.split("x"))
        emit("cell_before", prompt=prompt, batch=batch, allocated=weights, reserved=weights, max_allocated=weights)
        if batch > 4:
            emit("cell_error", prompt=prompt, batch=batch, error="CUDA out of memory: fake")
            continue
        cache = BYTES_PER_TOKEN * batch * (prompt + new - 1)
        hold(weights + cache + SLACK)
        emit("cell_after", prompt=prompt, batch=batch, new=new, seconds=0.01, cache_bytes=cache, cache_seq_len=prompt + new - 1,
             allocated=weights + cache, reserved_before_trim=weights + 2 * cache, reserved=weights + cache,
             max_allocated=weights + 2 * cache)
        hold(weights)
        emit("cell_freed", prompt=prompt, batch=batch, allocated=weights, reserved=weights, max_allocated=weights)
    emit("done", wait=False)


if sys.argv[1] == "alloc":
    alloc(int(sys.argv[sys.argv.index("--bytes") + 1]))
elif sys.argv[1] == "kv":
    kv(sys.argv[sys.argv.index("--cells") + 1], int(sys.argv[sys.argv.index("--new") + 1]))
