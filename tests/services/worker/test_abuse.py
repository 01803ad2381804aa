"""`trserve load --abuse` against a real worker (tenant tokens on, small caps): every bad kind gets
one of its expected status codes, nothing unexpected, and the worker still serves afterwards."""

from __future__ import annotations

import json
import secrets

import pytest

from trserve.services.common.security import TenantTokens
from trserve.services.load.abuse import AbuseConfig, run_abuse
from trserve.services.worker.config import Limits, WorkerConfig
from tests.services.worker_harness import serving

TOKENS = {f"ab-{i}": secrets.token_urlsafe(24) for i in range(3)}
MAX_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def worker(decoder):
    config = WorkerConfig(port=0, metrics_port=None, max_batch=4, max_queue=4, max_concurrent_rpcs=12,
                          max_request_bytes=MAX_BYTES, limits=Limits(max_new_tokens_cap=256, default_max_new_tokens=8),
                          tenant_tokens=TenantTokens.from_mapping(TOKENS))
    yield from serving(config, decoder)


def test_abuse_run_gets_only_expected_statuses_and_the_worker_keeps_serving(worker, tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    config = AbuseConfig(addr=worker.addr, duration_s=8, baseline_s=2, good_clients=1, bad_clients=3, tenants=3,
                         max_new_tokens=4, max_request_bytes=MAX_BYTES, tokens_file=str(tokens), call_timeout_s=30)
    report = run_abuse(config)
    print("\n" + report.format())
    summary = report.to_json()
    assert summary["unexpected"] == [] and summary["serving_after"], summary
    assert set(summary["bad_by_kind"]) == {
        "oversize body", "too many messages", "bad temperature", "too many stop strings", "too long stop string",
        "too many stop ids", "invalid ids", "cancel mid-stream", "stalled reader", "deadline too short",
        "foreign domain"}
    assert summary["bad_by_kind"]["foreign domain"].get("PERMISSION_DENIED", 0) >= 1
    assert summary["bad_by_kind"]["too many messages"].get("INVALID_ARGUMENT", 0) >= 1
    assert summary["good_codes"].get("OK", 0) >= 1 and summary["baseline_good_latency_s"]["n"] >= 1
    assert report.ok
