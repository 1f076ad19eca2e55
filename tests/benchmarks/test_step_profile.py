"""benchmarks/step_profile.py on the CPU (tiny BERT): the rows it writes and how it sorts kernel names."""
import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import step_profile


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("aten::addmm", "matmul"),
    ("mkldnn::_linear_pointwise", "matmul"),
    ("accel::onednn_mm", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_per_fused_native_layer_norm_7", "inductor fused"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
    ("triton_per_fused__to_copy_add_native_dropout_native_layer_norm_native_layer_norm_backward_view_7",
     "inductor fused, drawing"),
    ("triton_per_fused_add_native_dropout_backward_native_layer_norm_backward_19", "inductor fused"),
    ("triton_poi_fused_bernoulli_mul_3", "inductor fused, drawing"),
    ("void accel::layer_norm_fwd_kernel<float>", "layer_norm / dropout"),
    ("Memcpy DtoD (Device -> Device)", "copy / fill"),
    ("void at::native::reduce_kernel<512, 1>", "other"),
])
def test_kinds_of_kernel_names(name, kind):
    assert step_profile.kind_of(name) == kind


def test_a_profiled_mode_splits_its_step(tmp_path):
    # an accel:FIELD=VALUE variant too, as bert_base.py takes them (accel without compiling: quick)
    assert step_profile.main(["--quick", "--device", "cpu", "--modes", "eager,accel:compute.compile=false",
                              "--warmup", "1", "--steps", "1", "--top", "3", "--trace",
                              "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step_profile_cpu.json").read_text())
    row, variant = result["rows"]
    assert row["status"] == "ok" and row["mode"] == "eager" and result["workload"] == "fixed 4x32"
    assert variant["status"] == "ok" and variant["mode"] == "accel:compute.compile=false"
    assert 0 < row["busy_ms"] and row["gap_ms"] >= 0 and 0 < row["host_ms"] <= row["wall_ms"]
    assert row["host_calls"] == {"graph launches": 0, "kernel launches": 0, "syncs": 0, "copies": 0}  # no CUDA
    assert row["cudagraph_skips"] == 0 and row["cudagraph_skip_reasons"] == []  # none asked for on the CPU
    assert sum(row["kinds_ms"].values()) == pytest.approx(row["busy_ms"], rel=1e-6)
    assert len(row["top"]) == 3 and row["top"][0]["ms_per_step"] >= row["top"][-1]["ms_per_step"]
    assert (tmp_path / "step_profile_cpu.png").stat().st_size > 0
    # --trace: each mode's timeline, gzipped Chrome trace JSON, named after the mode in plain characters
    assert [r["trace"] for r in result["rows"]] == ["step_profile_cpu_eager.trace.json.gz",
                                                     "step_profile_cpu_accel_compute.compile_false.trace.json.gz"]
    for r in result["rows"]:
        with gzip.open(tmp_path / r["trace"], "rt") as f:
            assert json.load(f)["traceEvents"]


def test_bad_size_names_the_argument():
    with pytest.raises(SystemExit):
        step_profile.main(["--size", "32by128"])
    with pytest.raises(Exception, match="--size: expected BATCHxSEQ"):
        step_profile.parse_size("32by128")


def test_host_calls_count_the_cuda_api_by_kind_and_host_top_ranks_cpu_time():
    # what the profiler's key_averages() gives on CUDA: runtime and driver calls are CPU events; kernels are not
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(key=k, count=c, device_type=d, self_cpu_time_total=10 * c) for k, c, d in [
        ("cudaGraphLaunch", 4, cpu), ("cudaLaunchKernel", 600, cpu), ("cuLaunchKernel", 200, cpu),
        ("cuLaunchKernelEx", 2, cpu), ("cudaStreamSynchronize", 2, cpu), ("cudaDeviceSynchronize", 1, cpu),
        ("cudaMemcpyAsync", 6, cpu), ("aten::mm", 80, cpu), ("triton_poi_fused_add_0", 50, cuda)]]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert step_profile.host_calls(prof, steps=2) == {"graph launches": 2, "kernel launches": 401, "syncs": 1.5,
                                                      "copies": 3}
    top = step_profile.host_top(prof, steps=2, top=2)
    assert [(t["name"], t["calls_per_step"], t["ms_per_step"]) for t in top] == [
        ("cudaLaunchKernel", 300, 3.0), ("cuLaunchKernel", 100, 1.0)]
