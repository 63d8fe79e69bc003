"""The benchmarks' ``--isa`` caps: one environment for every side of a run."""

import benchmarks
from engine import kernel_choice


def test_avx2_sets_every_cap_and_native_clears_them(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    monkeypatch.setenv("PDLAB_UNRELATED", "kept")
    avx2 = benchmarks.isa_env("avx2")
    assert {k: avx2[k] for k in kernel_choice.ISA_ENV} == {
        "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "PDLAB_CPU_KERNELS_ISA": "avx2"}
    native = benchmarks.isa_env("native")
    assert not set(kernel_choice.ISA_ENV) & set(native)
    assert native["PDLAB_UNRELATED"] == avx2["PDLAB_UNRELATED"] == "kept"


def test_reexec_is_a_no_op_when_the_caps_already_hold(monkeypatch):
    for name, value in benchmarks.ISA_CAPS["avx2"].items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(benchmarks.os, "execve", lambda *a: calls.append(a))
    benchmarks.reexec_under_isa("benchmarks.vs_vllm", "avx2", [])
    assert calls == []
    benchmarks.reexec_under_isa("benchmarks.vs_vllm", "native", ["--quick"])
    (exe, argv, env), = calls
    assert argv[1:] == ["-m", "benchmarks.vs_vllm", "--quick"]
    assert not set(kernel_choice.ISA_ENV) & set(env)
