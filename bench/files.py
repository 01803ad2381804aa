"""`trserve bench --files`: the GGUF files users bring, one row each, beside llama.cpp's `llama-bench` on
the very same file and threads.

The files: the bundled model re-quantized to Q4_0, Q4_K_M, Q5_K_M, Q6_K and Q8_0 (by llama.cpp's own
`llama-quantize` where `make peers` built it, else bench/requant.py), a 1.7B model of
SmolLM2-1.7B's shape, one of Qwen3-0.6B's (per-head q/k norms) and one of Gemma-3-1B's (a window of 512 on
five local layers of six), random weights as Q4_K_M (bench/shaped.py), and `--model FILE` if
given; made once into bench-results/files/. Each file is loaded in a process of its own (its load
time and peak resident memory are its own), then: which path serves it (kernels, arithmetic, forward,
kernel kinds), load seconds, peak and steady RSS, and forward ms at widths 1/2/4/8/16 over 512 cached
tokens (the runner the decoders use). llama-bench beside it: its token time (tg64) and its batch of w
prompt tokens (pp w), in ms. Then, in another process, whether each file is served losslessly: `tr`
against `ar` token for token on held-out first turns (spec_bench, one per category after the bench's
first three) in both arithmetics, with each one's tokens per second; and for the real model's files
the int8 arithmetic's fidelity to the exact one (top-1 agreement and KL, teacher-forced over the exact
greedy continuations, as bench/fidelity.py measures). Written as JSON (bench-results/files.json) and
a table, with the host's CPU and ISA flags.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .converted import CONVERTED

BUNDLED = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
# Qwen3-0.6B's and Gemma-3-1B's shapes: issue 57's per-family rows
SHAPED = ("smollm2-1.7b:Q4_K_M", "qwen3-0.6b:Q4_K_M", "gemma3-1b:Q4_K_M")
_RECIPES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}  # requant's stand-in for the _M mixes


@dataclass(frozen=True)
class FilesConfig:
    files: tuple[str, ...] = ()  # more files (--model)
    bundled: tuple[str, ...] = BUNDLED
    shaped: tuple[str, ...] = SHAPED
    converted: tuple[str, ...] = CONVERTED  # bench/converted.py: a checkpoint and the converter's Q8_0 file
    widths: tuple[int, ...] = (1, 2, 4, 8, 16)
    threads: int | None = None
    arithmetic: str = "auto"
    prompts: int = 13  # held-out first turns for tr == ar (4 for random-weight files: their text means nothing)
    new_tokens: int = 64
    work_dir: str = "bench-results/files"
    json_path: str = "bench-results/files.json"


def make_files(config: FilesConfig) -> list[tuple[str, Path, Path]]:
    """(label, path, the GGUF file llama-bench runs beside it) of every model measured, made where missing."""
    from .converted import make_converted
    from .llama_server import find_tool
    from .runner import _bundled_gguf
    from .shaped import make_shaped

    work = Path(config.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    quantize, out = find_tool("llama-quantize"), [("bundled Q4_1 (shipped)", Path(_bundled_gguf()))]
    for qtype in config.bundled:
        path = work / f"smollm2-135m-{qtype}.gguf"
        if not path.exists():
            _requantize(quantize, _bundled_gguf(), path, qtype)
        out.append((f"bundled {qtype}", path))
    for item in config.shaped:
        shape, mix = item.split(":")
        path = work / f"{shape}-random-{mix}.gguf"
        if not path.exists():
            make_shaped(shape, mix, path)
        out.append((f"{shape} (random) {mix}", path))
    out = [(label, path, path) for label, path in out]
    for shape in config.converted:
        ckpt, gguf = make_converted(shape, work)
        out += [(f"{shape} (random) bf16 ckpt", ckpt, gguf), (f"{shape} (random) conv. Q8_0", gguf, gguf)]
    return out + [(Path(f).name, Path(f), Path(f)) for f in config.files]


def _requantize(quantize: Path | None, src: Path, dst: Path, qtype: str) -> None:
    if quantize is not None:
        subprocess.run([str(quantize), "--allow-requantize", str(src), str(dst), qtype], check=True,
                       capture_output=True)
        return
    from .requant import requantize

    main, high = _RECIPES.get(qtype, (qtype, None))
    requantize(src, dst, main, {f"blk.{i}.ffn_down.": high for i in range(0, 30, 2)} if high else None)


def measure_one(path: str, arithmetic: str, threads: int | None, widths: tuple[int, ...]) -> dict:
    """In this process: load `path`, then the forward cost per width (run as `python -m trserve.bench.files`)."""
    import torch

    from ..engine.model.kernels.qlinear import QLinear
    from ..engine.model.loader import ModelConfig, load_model
    from ..engine.tuning.calibrate import measure

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    loaded = load_model(ModelConfig(source=path, arithmetic=arithmetic, threads=threads))
    load_s = time.perf_counter() - t0
    steady = _status("VmRSS")
    cost = measure(loaded.model, widths=widths, kv_lens=(512,), reps=3, passes=2, native=loaded.native)
    kinds = sorted({m.kind for m in loaded.model.modules() if isinstance(m, QLinear)})
    return {"kernels": loaded.kernels, "arithmetic": loaded.arithmetic, "forward": loaded.forward, "kinds": kinds,
            "load_s": round(load_s, 1), "peak_rss_gb": round(_status("VmHWM") / 1e6, 2),
            "steady_rss_gb": round(steady / 1e6, 2),
            "width_ms": {str(w): round(1000 * s, 2) for w, s in zip(cost.widths, cost.seconds[0])}}


def lossless_one(path: str, threads: int | None, n_prompts: int, new_tokens: int, fidelity: bool) -> dict:
    """In this process: per arithmetic (exact, int8), tr == ar on held-out first turns and each one's tokens
    per second; with `fidelity`, int8's top-1 agreement and KL against exact over exact's greedy tokens."""
    import torch

    from ..core.datasets import prompt_file
    from ..engine import Decoder, DecoderConfig, GenerationRequest
    from ..engine.model.loader import ModelConfig
    from .fidelity import compare, held_out, summarise, teacher_forced

    texts, out, models, runs = held_out(str(prompt_file("spec_bench")), 1, 3)[:n_prompts], {}, {}, []
    for arith in ("exact", "int8"):
        d = Decoder(DecoderConfig(model=ModelConfig(source=path, arithmetic=arith, threads=threads)))
        if d.loaded.arithmetic != arith:
            out[arith] = {"error": f"served in {d.loaded.arithmetic}"}
            continue
        same, secs, tokens = 0, {"ar": 0.0, "tr": 0.0}, 0
        for text in texts:
            prompt = d.prompts.chat_ids([{"role": "user", "content": text}])
            res = {}
            for mode in ("ar", "tr"):
                t0 = time.perf_counter()
                res[mode] = d.generate(GenerationRequest(input_ids=prompt, max_new_tokens=new_tokens, mode=mode,
                                                         ignore_eos=True)).ids
                secs[mode] += time.perf_counter() - t0
            same, tokens = same + (res["tr"] == res["ar"]), tokens + len(res["ar"])
            if arith == "exact":
                runs.append((prompt, res["ar"]))
        out[arith] = {"tr_eq_ar": same, "prompts": len(texts), "ar_tok_s": round(tokens / secs["ar"], 1),
                      "tr_tok_s": round(tokens / secs["tr"], 1), "tr_over_ar": round(secs["ar"] / secs["tr"], 3)}
        models[arith] = d.loaded.model if fidelity else None
        del d
    if fidelity and all(models.values()):
        parts = []
        for prompt, ids in runs:
            ref = teacher_forced(models["exact"], prompt + ids, len(prompt))
            parts.append(compare(ref, teacher_forced(models["int8"], prompt + ids, len(prompt)), torch.tensor(ids)))
        summary = summarise(parts)
        out["fidelity"] = {k: summary[k] for k in ("top1_agreement", "kl_mean", "positions")}
    return out


def _status(field: str) -> int:
    """A /proc/self/status memory figure in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def llama_bench(path: Path, threads: int, widths: tuple[int, ...]) -> dict | None:
    """llama-bench's tg64 token time and pp w batch times in ms, or None where it is not built."""
    from .llama_server import find_tool

    tool = find_tool("llama-bench")
    if tool is None:
        return None
    pp = ",".join(str(w) for w in widths if w > 1)
    res = subprocess.run([str(tool), "-m", str(path), "-t", str(threads), "-p", pp, "-n", "64", "-r", "2", "-o", "json"],
                         capture_output=True, text=True, timeout=1800)
    if res.returncode:
        return {"error": res.stderr.strip().splitlines()[-1:]}
    out = {}
    for run in json.loads(res.stdout):  # avg_ts: tokens per second of the run
        if run["n_gen"]:
            out["tg_ms"] = round(1000 / run["avg_ts"], 2)
        else:
            out[f"pp{run['n_prompt']}_ms"] = round(1000 * run["n_prompt"] / run["avg_ts"], 2)
    return out


def run_files(config: FilesConfig) -> dict:
    import torch

    from .host import host_facts
    from .report import write_report

    threads = config.threads or torch.get_num_threads()
    report = {"config": asdict(config), "environment": {**host_facts(), "threads": threads,
                                                        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
              "files": []}
    for label, path, gguf in make_files(config):
        size = sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size
        row = {"file": label, "path": str(path), "mb": round(size / 1e6, 1), "llama_bench_file": gguf.name}
        row.update(_child(["measure", str(path), config.arithmetic, str(threads), ",".join(map(str, config.widths))]))
        row["llama_bench"] = llama_bench(gguf, threads, config.widths)
        real = label.startswith("bundled")  # a real model's file (else random weights: a few prompts, no fidelity)
        n = config.prompts if real else min(4, config.prompts)
        row["lossless"] = _child(["lossless", str(path), str(threads), str(n), str(config.new_tokens), str(int(real))])
        report["files"].append(row)
    write_report(config.json_path, report, format_files(report))
    return report


def _child(args: list[str]) -> dict:
    """`python -m trserve.bench.files ARGS` (a process of its own): its JSON result, or {"error": ...}."""
    res = subprocess.run([sys.executable, "-m", "trserve.bench.files", *args], capture_output=True, text=True)
    if res.returncode:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def format_files(report: dict) -> str:
    from .host import host_line

    env = report["environment"]
    widths = report["config"]["widths"]
    lines = [host_line(env),
             "file                            MB  path                             load s  peak/steady GB  "
             + "  ".join(f"w={w:<5}" for w in widths) + "  (trserve forward ms; llama-bench: tg ms, pp w ms)"]
    for row in report["files"]:
        head = f"{row['file']:<28} {row['mb']:>6}  "
        if "error" in row:
            lines.append(head + f"failed: {row['error']}")
            continue
        path = f"{row['kernels']}/{row['arithmetic']}/{row['forward']} k{','.join(map(str, row['kinds']))}"
        lines.append(head + f"{path:<32} {row['load_s']:>6}  {row['peak_rss_gb']:>5}/{row['steady_rss_gb']:<5}   "
                     + "  ".join(f"{row['width_ms'][str(w)]:<7}" for w in widths))
        lb = row.get("llama_bench")
        if lb and "error" not in lb:
            cells = [f"{lb.get('tg_ms', '-'):<7}"] + [f"{lb.get(f'pp{w}_ms', '-'):<7}" for w in widths[1:]]
            lines.append(" " * 88 + "llama.cpp " + "  ".join(cells))
        lines.append(" " * 30 + _lossless_cell(row.get("lossless") or {}))
    return "\n".join(lines)


def _lossless_cell(res: dict) -> str:
    """tr == ar per arithmetic (with tr's speed over ar's), and int8's fidelity to exact where measured."""
    if "error" in res:
        return f"lossless check failed: {res['error']}"
    cells = [f"{a}: tr==ar {r['tr_eq_ar']}/{r['prompts']} (tr {r['tr_tok_s']} / ar {r['ar_tok_s']} tok/s = "
             f"{r['tr_over_ar']}x)" if "error" not in r else f"{a}: {r['error']}"
             for a, r in res.items() if a in ("exact", "int8")]
    if "fidelity" in res:
        f = res["fidelity"]
        cells.append(f"int8 vs exact: top-1 {100 * f['top1_agreement']:.2f}%, KL {f['kl_mean']:.2e}")
    return "; ".join(cells)


if __name__ == "__main__":  # one file's measurement, in a process of its own
    if sys.argv[1] == "measure":
        _path, _arith, _threads, _widths = sys.argv[2:6]
        print(json.dumps(measure_one(_path, _arith, int(_threads), tuple(int(w) for w in _widths.split(",")))))
    else:
        _path, _threads, _n, _tokens, _fid = sys.argv[2:7]
        print(json.dumps(lossless_one(_path, int(_threads), int(_n), int(_tokens), _fid == "1")))
