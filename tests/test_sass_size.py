"""The decode kernels' machine code stays small (scripts/lab/sass_size.py says why: at 1-16 tokens
code size is on the critical path; the error paths moved out of line, with a clock-read
change worth 0.2-0.5 µs, made every such cycle 2.0-4.6 µs faster on an H100, 2026-12-06). A
change that grows the fused direct kernels past these budgets must show by one clock that it
is worth it, then raise the budget."""

import importlib.util
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# SASS instructions at sm_90, about 5 % of headroom. The direct padded path (template argument
# kDirectPadded = 0: 3,152 / 3,048 / 2,736) and the direct packed one (kDirectPacked = 6, the
# layer's default handle: 3,800 / 3,048 / 2,744; its dispatch also counts each expert's rows).
BUDGETS = {"dispatch_kernelILj0EE": 3300, "combine_kernelI13__nv_bfloat16Lj0EE": 3200,
           "combine_kernelIfLj0EE": 2900,
           "dispatch_kernelILj6EE": 4000, "combine_kernelI13__nv_bfloat16Lj6EE": 3200,
           "combine_kernelIfLj6EE": 2900}


def load():
    spec = importlib.util.spec_from_file_location(
        "sass_size", os.path.join(ROOT, "scripts", "lab", "sass_size.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sass = load()


# The budgets are nvcc 13.0's instruction counts: another compiler schedules differently.
@pytest.mark.skipif(sass.nvcc_release() != "13.0",
                    reason=f"budgets are for nvcc 13.0; nvcc here: {sass.nvcc_release()}")
def test_fused_direct_kernels_within_their_code_budget():
    pytest.importorskip("nvidia.nvshmem", reason="needs the NVSHMEM wheel's headers")
    cubin = sass.compile_cubin(os.path.join(ROOT, "csrc", "kernels", "fused.cu"), "90")
    sizes = {sass.short(name): n for name, n in sass.text_sizes(cubin).items()}
    for kernel, budget in BUDGETS.items():
        assert kernel in sizes, f"{kernel} not in {sorted(sizes)}"
        assert 1000 < sizes[kernel] <= budget, f"{kernel}: {sizes[kernel]} instructions"
    # the error paths stay out of line (a function of their own, not copies in every kernel)
    assert any("3jmc4failE" in name for name in sass.text_sizes(cubin))
