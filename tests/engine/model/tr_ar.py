"""TR == AR on a tiny model's native forward: the check each family's native tests end with."""

from __future__ import annotations

import torch


def assert_tr_equals_ar_natively(model, name: str, arithmetic: str, prompt_len: int = 30) -> None:
    """Three random prompts of ids below 256, decoded AR then TR on the native forward: the same ids
    exactly (no near-tie allowance there), and drafts accepted on one of them at least (MAT > 1.2),
    else the check would not have tested trees."""
    from trserve.engine import Decoder, DecoderConfig, GenerationRequest
    from trserve.engine.model.loader import LoadedModel
    from tests.conftest import DigitsTokenizer

    loaded = LoadedModel(model, DigitsTokenizer(), name, "tiny", torch.device("cpu"), torch.float32,
                         "compressed", "avx2", "native", arithmetic=arithmetic)
    dec = Decoder(DecoderConfig(k=8), loaded=loaded)
    assert dec.engine.runner.forward_kind == "native"
    accepted = []
    for s in range(3):
        ids = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(s)).tolist()
        ar = dec.generate(GenerationRequest(input_ids=ids, max_new_tokens=40, mode="ar", ignore_eos=True))
        tr = dec.generate(GenerationRequest(input_ids=ids, max_new_tokens=40, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids
        accepted.append(tr.stats.mat)
    assert max(accepted) > 1.2, f"drafts were hardly accepted ({accepted}): the test would not test trees"
