"""Build the C++ ops DeepSpeed compiles on a CPU machine at first use, into
``TORCH_EXTENSIONS_DIR``: its shared-memory all-reduce (every DeepSpeed process group builds
it: the first ``deepspeed.initialize`` of a run otherwise waits 30-60 s for it) and its CPU
Adam (the slow set's offload test). .ci/run builds them for the newest-torch job in the
background, at the lowest priority, while the first jobs run; the tests then load them."""

from __future__ import annotations

import time

from deepspeed.accelerator import get_accelerator

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")

if __name__ == "__main__":
    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible():
            print(f"{name}: not built on this machine (DeepSpeed does not use it here)")
            continue
        start = time.perf_counter()
        builder.load()
        print(f"{name}: ready after {time.perf_counter() - start:.0f} s (built or loaded)")
