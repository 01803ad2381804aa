import pytest

from trserve.core.errors import InvalidArgument
from trserve.core.model_spec import ModelSpec
from trserve.core.tenants import validate_tenant_id
from trserve.matrix_store import StoreConfig
from trserve.matrix_store.config import parse_model


@pytest.mark.parametrize(
    "fields",
    [
        {"redis_url": "localhost:6379"},
        {"key_prefix": ""},
        {"key_prefix": "trserve:"},
        {"snapshot_every_versions": 0},
        {"snapshot_every_s": 0.0},
        {"keep_snapshots": 0},
        {"max_tenants_in_memory": 0},
        {"max_batch_rows": -1},
        {"redis_timeout_s": 0},
    ],
)
def test_store_config_rejects_bad_values(fields: dict) -> None:
    with pytest.raises(ValueError):
        StoreConfig(**fields)


def test_store_config_defaults_are_memory_only() -> None:
    config = StoreConfig()
    assert config.redis_url is None and config.keep_snapshots == 3


@pytest.mark.parametrize("fields", [("", 10, 8), ("fp", 0, 8), ("fp", 10, 0), ("fp", 10, 65), ("fp", True, 8)])
def test_model_spec_rejects_bad_values(fields: tuple) -> None:
    with pytest.raises(InvalidArgument):
        ModelSpec(*fields)


@pytest.mark.parametrize("tenant", ["", "a" * 65, "a:b", "a b", "ü", "x/y", None, 7])
def test_bad_tenant_ids_are_refused(tenant: object) -> None:
    with pytest.raises(InvalidArgument, match="1-64 characters"):
        validate_tenant_id(tenant)


@pytest.mark.parametrize("tenant", ["a", "Acme.prod-1_x", "a" * 64])
def test_good_tenant_ids_pass(tenant: str) -> None:
    assert validate_tenant_id(tenant) == tenant


@pytest.mark.parametrize("tenant", ["_global", "_domain.legal", "_x"])
def test_reserved_ids_are_refused_from_callers_and_allowed_for_administration(tenant: str) -> None:
    with pytest.raises(InvalidArgument, match="reserved"):
        validate_tenant_id(tenant)
    assert validate_tenant_id(tenant, reserved_ok=True) == tenant


def test_served_models_and_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="max_matrix_bytes"):
        StoreConfig(models=(ModelSpec("big", 100_000_000, 8),))
    with pytest.raises(ValueError, match="twice"):
        StoreConfig(models=(ModelSpec("a", 10, 2), ModelSpec("a", 20, 2)))
    assert parse_model("smollm2:b:49152:8") == ModelSpec("smollm2:b", 49152, 8)
    with pytest.raises(ValueError, match="FINGERPRINT:VOCAB_SIZE:K"):
        parse_model("smollm2:8")
