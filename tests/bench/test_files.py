"""`trserve bench --files` (issue 55): each file measured in a process of its own, with its serving path,
load time, memory and forward ms per width; llama-bench beside it where built (not in CI)."""

from __future__ import annotations

import pytest

from trserve.engine.model.kernels.build import qlinear_supported

pytestmark = pytest.mark.skipif(not qlinear_supported(), reason="the compressed kernels need x86-64 Linux")


def test_files_table_measures_each_file_in_its_own_process(tmp_path):
    from trserve.bench.files import FilesConfig, run_files

    config = FilesConfig(bundled=(), shaped=("tiny:Q4_K_M",), converted=("tiny",), widths=(1, 2), threads=2,
                         arithmetic="exact", prompts=2, new_tokens=16, work_dir=str(tmp_path / "files"),
                         json_path=str(tmp_path / "files.json"))
    report = run_files(config)
    shipped, tiny, ckpt, converted = report["files"]
    # a random checkpoint quantized at load, and the same weights through llama.cpp's converter as Q8_0
    assert ckpt["file"] == "tiny (random) bf16 ckpt" and converted["file"] == "tiny (random) conv. Q8_0"
    assert ckpt["llama_bench_file"] == converted["llama_bench_file"] == "tiny-random-converted-Q8_0.gguf"
    for row in (ckpt, converted):
        assert (row["kernels"], row["forward"], row["arithmetic"]) == ("compressed", "native", "exact"), row
        assert row["lossless"]["exact"]["tr_eq_ar"] == 2, row["lossless"]
    assert converted["kinds"] == [8]  # Q8_0 blocks as they are
    assert shipped["file"].startswith("bundled Q4_1") and "error" not in shipped, shipped
    assert tiny["kernels"] == "compressed" and tiny["forward"] == "native" and tiny["arithmetic"] == "exact"
    assert 6 in tiny["kinds"] and 20 in tiny["kinds"]  # Q4_K and Q6_K blocks as they are (two-level scales)
    for row in (shipped, tiny):
        assert row["load_s"] > 0 and 0 < row["steady_rss_gb"] <= row["peak_rss_gb"]
        assert set(row["width_ms"]) == {"1", "2"} and all(v > 0 for v in row["width_ms"].values())
    assert shipped["width_ms"]["1"] > tiny["width_ms"]["1"]  # 135M parameters against 2 tiny layers
    # lossless in both arithmetics on every file; int8's fidelity to exact on the real model's
    for row, n in ((shipped, 2), (tiny, 2)):
        for arith in ("exact", "int8"):
            assert row["lossless"][arith]["tr_eq_ar"] == row["lossless"][arith]["prompts"] == n, row["lossless"]
    assert shipped["lossless"]["fidelity"]["top1_agreement"] > 0.9 and "fidelity" not in tiny["lossless"]
    text = (tmp_path / "files.txt").read_text()
    assert "exact: tr==ar 2/2" in text and "int8 vs exact: top-1" in text
    assert "host:" in text and "tiny (random) Q4_K_M" in text and "compressed/exact/native" in text
