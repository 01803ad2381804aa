"""A prepared accelerator check: one short run where a CUDA GPU is lent, on the CPU in the tests.

    python -m trserve.bench.device_check --out DIR            # CUDA when present: graphs; ~2-3 minutes on one GPU
    python -m trserve.bench.device_check --out DIR --tiny     # a tiny config on any device (what the tests run)

The bundled model does not travel to such a machine (its weights come from a package), so the
models are random-initialised ones of real configs (SmolLM2-135M's and a Llama-3.2-1B-like one), and
the check covers what the weights do not decide:

1. tree == per path: the runner's batch step (fixed-shape buckets, a CUDA graph each on CUDA) over
   B rows with the 81-node paper tree each, against each sampled node's path decoded causally alone
   (float32 model): max |logit difference| and argmax agreement.
2. TR == AR: the batching engine decodes N random prompts at once in TR mode, and each output must
   equal the serial plain-decoding output of the same prompt (float32 model; the LM head scaled so
   that the next-token laws are peaked and drafts get accepted; MAT reported).
3. cost per width and batch: one batch step's milliseconds at B rows x W tokens over 512 cached
   tokens each, CUDA graphs against eager, in bfloat16 (the serving dtype on CUDA).

Writes DIR/device-check.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

CONFIGS = {  # real shapes (random weights); untied heads so the head alone can be scaled
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048),
}
PEAK = 20.0  # LM head scale for the lossless check: peaked next-token laws


class _IdsTokenizer:
    """The engine only decodes: ids as text."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0, peak: float = 1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**CONFIGS[name], tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    return model.to(dtype).eval()


def _step_kind(device: torch.device) -> str:
    return "graphs" if device.type == "cuda" else "static"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def tree_check(name: str, device: torch.device, rows: int, nodes: int) -> dict:
    from ..engine.model.runner import ModelRunner, RowInput
    from ..engine.tr.tree import compile_tree, load_template

    model = _model(name, torch.float32, device)
    vocab = model.config.vocab_size
    runner = ModelRunner(model, rows, torch.float32, batch_step=_step_kind(device))
    tree = compile_tree(load_template("paper"), device)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, vocab, (5 + 37 * b,), generator=g).to(device) for b in range(rows)]
    for ctx in contexts:
        row = runner.kv.open_row()
        runner.prefill(row, ctx, torch.tensor([ctx.shape[0] - 1], device=device))
        runner.kv.activate(row)
    tokens = [torch.randint(0, vocab, (tree.n,), generator=g).to(device) for _ in range(rows)]
    logits = runner.step([RowInput(t, tree.depth, tree.mask) for t in tokens])
    worst, agree, total = 0.0, 0, 0
    for b in range(rows):
        for node in torch.linspace(0, tree.n - 1, nodes).round().long().tolist():
            ids = torch.cat([contexts[b], tokens[b][tree.path_to(node)]])[None]
            ref = model(input_ids=ids).logits[0, -1].float()
            worst = max(worst, float((logits[b][node] - ref).abs().max()))
            agree += int(logits[b][node].argmax() == ref.argmax())
            total += 1
    captured = runner.static.captured if runner.static is not None else 0  # 0 on CUDA: the capture failed
    return {"model": name, "rows": rows, "tree_nodes": tree.n, "nodes_checked": total, "argmax_agree": agree,
            "max_abs_diff": worst, "batch_step": runner.batch_step, "graphs_captured": captured,
            "ok": agree == total and worst < 1e-3 and (captured > 0 or device.type != "cuda")}


@torch.inference_mode()
def lossless_check(name: str, device: torch.device, prompts: int, new_tokens: int) -> dict:
    from ..engine import Decoder, DecoderConfig, GenerationRequest
    from ..engine.engine import BatchEngine, EngineConfig
    from ..engine.model.loader import LoadedModel
    from ..engine.results import GenerationResult

    model = _model(name, torch.float32, device, peak=PEAK)
    vocab = model.config.vocab_size
    loaded = LoadedModel(model, _IdsTokenizer(), f"random-{name}", name, device, torch.float32, "stock",
                         batch_step=_step_kind(device))
    decoder = Decoder(DecoderConfig(k=8, tree="paper", seed_from_prompt=0), loaded=loaded)
    g = torch.Generator().manual_seed(2)
    requests = [torch.randint(0, vocab, (8 + 29 * i,), generator=g).tolist() for i in range(prompts)]
    want = [decoder.generate(GenerationRequest(input_ids=p, max_new_tokens=new_tokens, ignore_eos=True,
                                               mode="ar")).ids for p in requests]
    engine = BatchEngine(decoder, EngineConfig(max_batch=prompts, prefill_chunk=128, batch_aware=False))  # whole trees
    outs: list[list] = [[] for _ in requests]
    for p, out in zip(requests, outs):
        req = GenerationRequest(input_ids=p, max_new_tokens=new_tokens, ignore_eos=True, mode="tr")
        engine.submit(decoder.prepare(req), out.append, matrix=decoder.new_matrix())
    t0 = time.perf_counter()
    with engine.stepping():
        while engine.running or engine.waiting or engine.prefilling:
            engine.step()
    seconds = time.perf_counter() - t0
    results = [o[-1] for o in outs]
    same = sum(isinstance(r, GenerationResult) and r.ids == w for r, w in zip(results, want))
    mats = [r.stats.mat for r in results if isinstance(r, GenerationResult)]
    return {"model": name, "prompts": prompts, "new_tokens": new_tokens, "same_as_ar": same, "engine_steps": engine.steps,
            "mean_mat": statistics.fmean(mats) if mats else 0.0, "seconds": seconds, "ok": same == prompts}


@torch.inference_mode()
def cost_check(name: str, device: torch.device, batches: list[int], widths: list[int], kv: int, reps: int) -> dict:
    from ..engine.model.runner import ModelRunner, RowInput

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _model(name, dtype, device)
    vocab = model.config.vocab_size
    kinds = [_step_kind(device), "eager"]
    g = torch.Generator().manual_seed(3)
    cells = []
    for b in batches:
        runners = {kind: ModelRunner(model, b, dtype, batch_step=kind) for kind in kinds}
        for runner in runners.values():
            for _ in range(b):
                row = runner.kv.open_row()
                runner.prefill(row, torch.randint(0, vocab, (kv,), generator=g).to(device),
                               torch.tensor([kv - 1], device=device))
                runner.kv.activate(row)
        for w in widths:
            rows = [RowInput(torch.randint(0, vocab, (w,), generator=g).to(device), torch.arange(w, device=device),
                             torch.zeros(w, w, dtype=dtype, device=device)) for _ in range(b)]
            cell = {"rows": b, "width": w, "tokens": b * w}
            for kind, runner in runners.items():  # steps are not kept: every call has the same shapes
                for _ in range(3):
                    runner.step(rows)
                times = []
                for _ in range(reps):
                    _sync(device)
                    t0 = time.perf_counter()
                    runner.step(rows)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                cell[f"{kind}_ms"] = 1000 * statistics.median(times)
            cells.append(cell)
    return {"model": name, "kv": kv, "dtype": str(dtype).replace("torch.", ""), "cells": cells, "ok": True}


def _guarded(check, *args) -> dict:
    """check(*args), or where it raises, the error and where (ok False)."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 - the report must say what failed and go on
        return {"model": args[0], "error": f"{type(e).__name__}: {e}", "where": traceback.format_exc(limit=-6),
                "ok": False}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for device-check.json")
    p.add_argument("--tiny", action="store_true", help="a tiny config and sizes (any device; what the tests run)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda:0, ...")
    args = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.tiny:
        names, rows, nodes, prompts, new, batches, widths, kv, reps = ["tiny"], 2, 4, 3, 12, [1, 2], [1, 4], 32, 2
    else:
        names, rows, nodes, prompts, new = ["smollm2-135m", "llama-1b"], 4, 8, 8, 64
        batches, widths, kv, reps = [1, 4, 16, 64], [1, 4, 16, 64], 512, 10
    report = {"device": str(device), "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "tree": [], "lossless": [], "cost": []}
    t0 = time.perf_counter()
    for name in names:
        for part, check, more in (("tree", tree_check, (rows, nodes)), ("lossless", lossless_check, (prompts, new)),
                                  ("cost", cost_check, (batches, widths, kv, reps))):
            report[part].append(_guarded(check, name, device, *more))  # one failing check keeps the others
            shown = {k: v for k, v in report[part][-1].items() if k != "cells"}
            print(f"[{time.perf_counter() - t0:6.1f}s] {part}: {json.dumps(shown)}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for c in report["cost"]:
        if "cells" not in c:
            continue
        print(f"{c['model']} ({c['dtype']}, kv {c['kv']}): ms per batch step")
        keys = [k for k in c["cells"][0] if k.endswith("_ms")]
        print(f"{'rows':>5} {'width':>6} " + " ".join(f"{k[:-3]:>8}" for k in keys))
        for cell in c["cells"]:
            print(f"{cell['rows']:>5} {cell['width']:>6} " + " ".join(f"{cell[k]:8.2f}" for k in keys))
    report["ok"] = all(x["ok"] for part in ("tree", "lossless", "cost") for x in report[part])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device-check.json").write_text(json.dumps(report, indent=1))
    print("device check:", "ok" if report["ok"] else "FAILED")
    return report


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
