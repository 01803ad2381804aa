import pytest

from core.errors import InvalidArgument
from core.model_spec import ModelSpec
from matrix_store import StoreConfig
from matrix_store.config import validate_tenant_id


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


@pytest.mark.parametrize("tenant", ["a", "_global", "Acme.prod-1_x", "a" * 64])
def test_good_tenant_ids_pass(tenant: str) -> None:
    assert validate_tenant_id(tenant) == tenant
