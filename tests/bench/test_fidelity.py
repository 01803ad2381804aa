"""`trserve bench --fidelity` on a few real prompts: it compares the int8 arithmetic with the exact one
(not the default with itself), so int8's logits differ from the reference's and the figures say so."""

from __future__ import annotations

import json

import pytest

from trserve.bench.fidelity import FidelityConfig, held_out, run_fidelity
from trserve.core.datasets import prompt_file


def test_fidelity_compares_int8_with_the_exact_model(tmp_path):
    from trserve.engine.model.kernels.build import qlinear_supported

    if not qlinear_supported():
        pytest.skip("the int8 arithmetic needs the compressed kernels (x86-64 Linux)")
    prompts = tmp_path / "two.jsonl"
    questions = held_out(str(prompt_file("spec_bench")), per_category=1, skip_first=3)[:2]
    prompts.write_text("".join(json.dumps({"category": "c", "turns": [q]}) + "\n" for q in ["", "", "", *questions, ""]))
    report = run_fidelity(FidelityConfig(prompts=str(prompts), new_tokens=12, per_category=2, bfloat16=False,
                                         json_path=str(tmp_path / "fidelity.json")))
    int8 = report["modes"]["int8"]
    assert report["prompts"] == 2 and int8["positions"] == 24
    assert int8["kl_mean"] > 0  # another arithmetic: its laws differ from the exact model's somewhere
    assert int8["top1_agreement"] > 0.8  # and it is close to it
    assert report["logits_sha256"]["int8"] != report["logits_sha256"]["exact"]


def test_fidelity_of_a_checkpoint_measures_its_format_in_both_arithmetics_against_its_float_weights(tmp_path):
    """A checkpoint `--model`: the reference is its float weights (`--quantize none`), and the format is
    measured quantized at load in both arithmetics (what the default `--quantize` was chosen by)."""
    from trserve.engine.model.kernels.build import qlinear_supported
    from tests.engine.model.test_checkpoint import _tiny

    if not qlinear_supported():
        pytest.skip("the quantized checkpoint needs the compressed kernels (x86-64 Linux)")
    folder = _tiny(tmp_path / "ckpt", "llama")
    prompts = tmp_path / "two.jsonl"
    questions = held_out(str(prompt_file("spec_bench")), per_category=1, skip_first=3)[:2]
    prompts.write_text("".join(json.dumps({"category": "c", "turns": [q]}) + "\n" for q in ["", "", "", *questions, ""]))
    report = run_fidelity(FidelityConfig(prompts=str(prompts), new_tokens=8, per_category=2, bfloat16=False,
                                         model=str(folder), quantize="q8_0", json_path=str(tmp_path / "f.json")))
    assert set(report["modes"]) == {"q8_0 exact", "q8_0 int8"}
    for mode in report["modes"].values():
        assert mode["positions"] == 16 and mode["kl_mean"] > 0  # quantized: not the float weights' laws
    assert len(set(report["logits_sha256"].values())) == 3
