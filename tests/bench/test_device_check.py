"""The prepared accelerator check runs end to end (tiny config, on the CPU: the static batch step)."""

import json

import torch

from trserve.bench.device_check import main


def test_device_check_runs_and_its_checks_pass(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = main(["--out", str(tmp_path), "--tiny", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert report["ok"] and json.loads((tmp_path / "device-check.json").read_text())["ok"]
    (tree,), (lossless,), (cost,) = report["tree"], report["lossless"], report["cost"]
    assert tree["batch_step"] == "static" and tree["argmax_agree"] == tree["nodes_checked"] == 8
    assert lossless["same_as_ar"] == 3 and lossless["mean_mat"] > 1.0  # drafts were accepted, and lossless
    assert [(c["rows"], c["width"]) for c in cost["cells"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(c["static_ms"] > 0 and c["eager_ms"] > 0 for c in cost["cells"])
    assert "device check: ok" in capsys.readouterr().out


def test_a_failing_check_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    import trserve.bench.device_check as dc

    def broken(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(dc, "lossless_check", broken)
    report = dc.main(["--out", str(tmp_path), "--tiny", "--device", "cpu"])
    assert not report["ok"] and "stream is capturing" in report["lossless"][0]["error"]
    assert report["tree"][0]["ok"] and report["cost"][0]["cells"]
