"""bench/profile_step.py's trace reduction: busy time is the UNION of GPU intervals (overlapping
kernels on two streams count once), idle gaps are excluded, kernels land in the right category."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_summarize_union_and_categories(tmp_path):
    import profile_step

    ev = [  # microseconds; 2 steps
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "ts": 50, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_gelu_0", "ts": 300, "dur": 50},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 360, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # host side: ignored
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    s = profile_step.summarize(str(path), steps=2)
    assert s["wall_ms_per_step"] == 0.185  # 0 .. 370 us over 2 steps
    assert s["gpu_busy_ms_per_step"] == 0.105  # (150 + 50 + 10) / 2: the overlap counted once
    cats = s["ms_per_step_by_category"]
    assert cats == {"gemm": 0.05, "attention": 0.05, "triton_pointwise": 0.025, "memcpy": 0.005}
    assert s["top_kernels"][0]["calls_per_step"] == 0.5
    # the GPU waits 150 us after the flash kernel (the one that ended last) for the gelu kernel
    assert s["idle_gaps"][0] == {"before": "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>",
                                 "after": "triton_poi_fused_add_gelu_0", "ms_per_step": 0.075, "per_step": 0.5}
    assert len(s["idle_gaps"]) == 2  # and 10 us between the gelu and the memcpy


def test_trainer_timing_leaves_out_the_drain():
    """The trainer keeps one step in flight, so its last iteration also waits for its own step:
    bench/train_throughput.trainer_timing averages warm-up+1 .. last-1 (a 48 ms drain would
    otherwise add ~1/30 to a 24 ms step)."""
    import train_throughput as tt

    times = [30000.0, 400.0, 24.0, 24.0, 24.0, 24.0, 48.0]
    t = tt.trainer_timing(times, warmup=2, mb=12, n_params=124_475_904, size=(12, 768, 12))
    assert t["step_ms"] == 24.0 and t["timed_iterations"] == 4 and t["last_iteration_ms"] == 48.0
    assert t["tokens_per_s"] == round(12 * 1024 / 0.024)


def test_kernels_are_attributed_to_the_host_op_that_launched_them(tmp_path):
    """With host ops in the trace (--ops): kernel -> its runtime launch (correlation) -> the op
    (External id), with input shapes; a kernel replayed from a CUDA graph has no op and gets none."""
    import profile_step

    ev = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::sum", "ts": 0, "dur": 5,
         "args": {"External id": 7, "Input Dims": [[12288, 768], []]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 1,
         "args": {"External id": 7, "correlation": 100}},
        {"ph": "X", "cat": "kernel", "name": "reduce_kernel<128, 4>", "ts": 10, "dur": 15, "args": {"correlation": 100}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 2, "dur": 1, "args": {"correlation": 101}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 30, "dur": 5, "args": {"correlation": 101}},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    top = {k["name"]: k for k in profile_step.summarize(str(path), steps=1)["top_kernels"]}
    assert top["reduce_kernel<128, 4>"]["launched_by"] == ["aten::sum [[12288, 768], []] x1"]
    assert "launched_by" not in top["triton_poi_fused_add_0"]
