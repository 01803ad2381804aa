"""A serial reference decode loop (one request, one KV row, the whole tree every TR step, the
prompt prefilled at once), kept as a test oracle for the engine: the product decodes only through
engine/engine.py:BatchEngine. Same forward, drafting and acceptance functions, none of the engine's
scheduling, chunking or budgets."""

from __future__ import annotations

import torch

from trserve.engine.model.runner import ModelRunner, RowInput
from trserve.engine.request.request import GenerationRequest
from trserve.engine.request.stops import StopChecker
from trserve.engine.request.text import reply_decoder
from trserve.engine.results import GenerationResult
from trserve.engine.sequence import Sequence
from trserve.engine.drafting.step import accept_step, draft_step
from trserve.engine.target import TargetModel
from trserve.engine.tr.lookup import ContextLookup
from trserve.engine.tr.recycle import recycle_rows
from trserve.engine.tr.sampling import choose, new_sampler
from trserve.engine.tuning.online import StepPlan


def serial_generate(target: TargetModel, request: GenerationRequest, matrix=None) -> GenerationResult:
    """Decode `request` alone to the end (greedy or sampled as it asks); `matrix` as Decoder.generate's."""
    prepared = target.prepare(request)
    req, tree = prepared.request, prepared.tree
    seq = Sequence(prepared, StopChecker(target.tokenizer, set(prepared.stop_ids), req.stop_strings),
                   new_sampler(req.sampling, req.max_new_tokens, target.device))
    runner = ModelRunner(target.model, 1, target.loaded.dtype, native=target.loaded.native, topk=target.config.k)
    source = target.draft_source(matrix) if req.mode == "tr" else None
    with torch.inference_mode(), target.model_lock:
        return _decode(target, runner, seq, source, tree)


def _decode(target: TargetModel, runner: ModelRunner, seq: Sequence, source, tree) -> GenerationResult:
    ids, k, dev = list(seq.prepared.ids), target.config.k, target.device
    row = runner.kv.open_row()
    prompt = torch.tensor(ids, device=dev)
    seed = min(len(ids), target.config.seed_from_prompt) if source else 0
    need = torch.arange(len(ids) - max(seed, 1), len(ids), device=dev)
    logits = runner.prefill(row, prompt, need)  # [max(seed, 1), V]
    runner.kv.activate(row)
    root = int(choose(logits[-1:], seq.sampler, 0)[0])
    recycled = recycle_rows(prompt[-seed:], logits, k, list(range(seed)), runner.last_topk) if seed else None
    session = source.open(tree, target.spec) if source else None
    if session is not None:
        seq.drafting.lookup = ContextLookup(ids, max_ngram=len(tree.template.lookup))
    seq.commit([root])
    while seq.finish_reason is None:
        if session is None:
            out = runner.step([RowInput(torch.tensor([root], device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                                        torch.zeros(1, 1, dtype=runner.dtype, device=dev))])[0]  # [1, V]
            top = runner.last_topk[0] if runner.last_topk is not None else None
            new, path = [int(choose(out, seq.sampler, len(seq.generated), top)[0])], [0]
        else:
            draft = draft_step(seq, session.step(recycled, root), StepPlan(tree, None, explore=False))
            out = runner.step([RowInput(draft.tokens, draft.tree.depth, draft.tree.mask)])[0]  # [n + chain, V]
            top = runner.last_topk[0] if runner.last_topk is not None else None
            acc, recycled = accept_step(seq, draft, out, k, top)
            new, path = acc.tokens, acc.path
        runner.keep([path])
        new = seq.commit(new)
        seq.accepted_per_step.append(len(new))
        root = new[-1] if new else root
    if session is not None:
        session.close(recycled)
    text = seq.stops.cut_text(reply_decoder(target.tokenizer, seq.prepared.request.kept_special)(seq.generated))
    return GenerationResult(ids=seq.generated, text=text, finish_reason=seq.finish_reason, stats=None)
