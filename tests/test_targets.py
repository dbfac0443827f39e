"""GPU target registry and --gpu resolution (no GPU needed)."""
import pytest

from flashtune import targets


def test_registry_has_the_five_gpus_with_limits():
    for short in ("A100", "H100", "H200", "L40S", "RTX4090"):
        t = targets.get(short)
        assert t.sm_count > 0 and t.smem_per_block > 48 * 1024 and t.regs_per_sm == 65536
        assert t.peak_tflops_bf16 > 0 and t.mem_bw_gbps > 0 and t.l2_bytes > 0
    assert targets.get("h100").has("tma") and not targets.get("A100").has("tma")
    assert targets.get("rtx-4090").short == "RTX4090"


def test_unknown_gpu_names_the_known_ones():
    with pytest.raises(targets.GpuMismatch, match="H100"):
        targets.resolve("B300", present=False)


def test_gpu_must_match_the_one_present():
    h100 = targets.get("H100")
    assert targets.resolve("H100", present=h100) is h100
    assert targets.resolve("auto", present=h100) is h100
    with pytest.raises(targets.GpuMismatch) as e:
        targets.resolve("A100", present=h100)
    assert "NVIDIA H100 80GB HBM3" in str(e.value) and "--gpu H100" in str(e.value)


def test_no_gpu_is_a_clear_error():
    with pytest.raises(targets.GpuMismatch, match="no CUDA GPU found"):
        targets.resolve("A100", present=None)
    with pytest.raises(targets.GpuMismatch, match="no CUDA GPU found"):
        targets.resolve("auto", present=None)
    # a dry run inspects any GPU's space without one
    assert targets.resolve("A100", present=False).short == "A100"
