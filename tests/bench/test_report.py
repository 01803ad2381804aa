"""The bench report's draft tokens per source: aggregation and table (pure functions, no model)."""

import pytest

from trserve.bench.report import draft_sources, format_table, summarise


def _rec(decoder, category, qid, drafted=None, accepted=None, turn=0):
    r = {"decoder": decoder, "question_id": qid, "category": category, "turn": turn, "ids": [1, 2], "seconds": 1.0,
         "tokens": 2, "steps": 2, "step_tokens": 2}
    if drafted is not None:
        r.update(drafted=drafted, accepted=accepted)
    return r


def test_draft_sources_sums_per_source_and_rates():
    rows = [{"drafted": {"matrix": 10, "context": 4}, "accepted": {"matrix": 3, "context": 4}},
            {"drafted": {"matrix": 6, "history": 5}, "accepted": {"history": 1}},
            {"drafted": {}, "accepted": {}},  # a TR request that never drafted
            {"tokens": 3}]  # no counters: not a TR request, ignored
    out = draft_sources(rows)
    assert list(out["by_source"]) == ["matrix", "context", "history"]  # the engine's order, not dict order
    assert out["by_source"]["matrix"] == {"drafted": 16, "accepted": 3, "acceptance": pytest.approx(0.1875)}
    assert out["by_source"]["context"] == {"drafted": 4, "accepted": 4, "acceptance": 1.0}
    assert out["by_source"]["history"] == {"drafted": 5, "accepted": 1, "acceptance": 0.2}
    assert out["total"] == {"drafted": 25, "accepted": 8, "acceptance": 0.32}


def test_draft_sources_edge_cases():
    assert draft_sources([]) is None
    assert draft_sources([{"tokens": 1}]) is None
    assert draft_sources([{"drafted": {}, "accepted": {}}]) == {
        "by_source": {}, "total": {"drafted": 0, "accepted": 0, "acceptance": None}}
    # an unknown source sorts after the known ones; accepted without drafted has no rate
    out = draft_sources([{"drafted": {"zeta": 2, "matrix": 1}, "accepted": {"zeta": 1, "omega": 1}}])
    assert list(out["by_source"]) == ["matrix", "omega", "zeta"]
    assert out["by_source"]["omega"] == {"drafted": 0, "accepted": 1, "acceptance": None}


def test_report_has_sources_per_tr_decoder_and_category_only():
    records = [_rec("ar", "agent", 1), _rec("ar", "extraction", 2),
               _rec("tr", "agent", 1, {"matrix": 8, "context": 2}, {"matrix": 2, "context": 2}),
               _rec("tr", "extraction", 2, {"matrix": 2}, {"matrix": 1})]
    report = summarise(records, ["ar", "tr"])
    assert "draft_sources" not in report["decoders"]["ar"]
    assert report["decoders"]["tr"]["draft_sources"]["total"] == {"drafted": 12, "accepted": 5,
                                                                  "acceptance": pytest.approx(5 / 12, abs=1e-4)}
    assert report["per_category"]["agent"]["tr"]["draft_sources"]["by_source"]["context"]["acceptance"] == 1.0
    assert "draft_sources" not in report["per_category"]["agent"]["ar"]
    assert report["decoders"]["tr"]["mat"] == 1.0  # the existing keys stay
    lines = format_table(report).splitlines()
    head = lines.index("draft sources: accepted / drafted tokens (acceptance)")
    assert lines[head + 1].split() == ["decoder", "category", "matrix", "context", "total"]
    assert lines[head + 2].split() == ["tr", "all", "3/10", "(30.0%)", "2/2", "(100.0%)", "5/12", "(41.7%)"]
    assert lines[head + 4].split() == ["tr", "extraction", "1/2", "(50.0%)", "-", "1/2", "(50.0%)"]
    assert len(lines) == head + 5


def test_table_has_no_source_section_without_tr():
    report = summarise([_rec("ar", "agent", 1)], ["ar"])
    assert "draft sources" not in format_table(report)


def test_table_says_how_many_outputs_equal_ar_and_names_the_host():
    """Every greedy bench run shows TR == AR per prompt and turn (the lossless claim in every table), and
    the host's CPU and ISA flags at its head."""
    different = _rec("tr", "agent", 2)
    different["ids"] = [1, 3]
    records = [_rec("ar", "agent", 1), _rec("ar", "agent", 2), _rec("ar", "agent", 1, turn=1),
               _rec("tr", "agent", 1), different, _rec("tr", "agent", 1, turn=1)]
    report = summarise(records, ["ar", "tr"])
    assert report["decoders"]["tr"]["identical_to_ar"] == "2/3"
    assert "identical_to_ar" not in report["decoders"]["ar"]
    assert "identical_to_ar" not in summarise(records, ["ar", "tr"], sampled=True)["decoders"]["tr"]
    report["environment"] = {"cpu": "Some CPU", "threads": 2, "isa_flags": ["avx2", "avx512_vnni"],
                             "isa": "avx512vnni", "arithmetic": "int8"}
    lines = format_table(report).splitlines()
    assert lines[0] == "host: Some CPU, 2 threads; avx2 avx512_vnni; kernels avx512vnni, int8"
    assert lines[1].endswith("same as hf  same as ar  tokens")
    assert lines[3].split()[0] == "tr" and lines[3].split()[-2:] == ["2/3", "6"]  # same as ar, tokens
