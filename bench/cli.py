"""`trserve bench`: TR vs plain greedy generate vs prompt lookup, side by side in one process."""

from __future__ import annotations

from ..core.datasets import PROMPT_SETS, agent_file, prompt_file
from ..engine.model.choices import ARITHMETIC_CHOICES, QUANTIZE_CHOICES

DEFAULT_PROMPTS = str(prompt_file("spec_bench"))  # bundled with the repository (core/data/)
DECODERS = ("hf", "pld", "ar", "tr", "tr-paper")
OPTIONAL = ("tr-static", "tr-full", "tr-matrix", "tr-adaptive", "llamacpp", "llama-server", "llama-server-ngram")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark TR against HF generate and prompt lookup decoding")
    p.add_argument("--workload", default="spec_bench", choices=PROMPT_SETS,
                   help="bundled prompt set (core/data/): spec_bench (default), mbpp (code), or repetitive (code "
                        "edits, one-template extraction, agent loops re-sending their context); with --concurrency, "
                        "repetitive sends both turns and makes each category one tenant")
    p.add_argument("--prompts", default=None,
                   help="Spec-Bench style jsonl (question_id, category, turns); given, it replaces the workload's file")
    p.add_argument("--per-category", type=int, default=1, help="questions per category (the first N in file order)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--warm-per-category", type=int, default=0,
                   help="hot start: first turns of N more questions per category (never measured) through the TR "
                        "decoders first, untimed, so their matrices start as after earlier traffic")
    p.add_argument("--decoders", default=",".join(DECODERS), help=f"comma list from {','.join(DECODERS + OPTIONAL)}")
    p.add_argument("--tree", default=None, help="tree for the 'tr' decoder (default: this installation's default)")
    p.add_argument("--first-turn-only", action="store_true",
                   help="skip the second turn of multi-turn questions (--concurrency sends first turns only "
                        "anyway, except with --workload repetitive)")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for the 'pld' decoder")
    p.add_argument("--model", default=None, help="model source, in every mode (default: the bundled "
                   "SmolLM2-135M-Instruct; the llama.cpp peers need a .gguf file)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--kernels", default="auto", choices=("auto", "stock", "packed", "compressed"),
                   help="kernels of trserve's decoders (ar, tr*); hf and pld always use stock transformers")
    p.add_argument("--arithmetic", default="auto", choices=ARITHMETIC_CHOICES,
                   help="the compressed kernels' arithmetic of trserve's decoders: auto (default: as a worker serves, int8 "
                        "wherever they run), exact or int8")
    p.add_argument("--quantize", default="auto", choices=QUANTIZE_CHOICES,
                   help="a checkpoint --model's linears quantized at load (as `serve --quantize`), for trserve's "
                        "decoders and --fidelity (which then also measures each format against the float weights)")
    p.add_argument("--forward", default="auto", choices=("auto", "native", "transformers"),
                   help="what runs trserve's forwards: the native one-call forward where it fits, or transformers")
    p.add_argument("--gguf", default=None, help="GGUF for the llamacpp decoder (default: the bundled model's)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 = every decoder samples at this temperature (no top-k/top-p), "
                        "seeded per prompt")
    p.add_argument("--json", default=None, help="where to write the JSON report (default bench-results/bench.json, "
                   "or bench-results/concurrency.json with --concurrency)")
    _instead(p)
    p.add_argument("--concurrency", default=None,
                   help="e.g. 1,2,4,8,16: instead of the decoder comparison, closed-loop load on the batching engine "
                        "(modes tr, ar, serial) with throughput, latency and TTFT per level (bench/concurrency.py)")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --concurrency: runs per level, the modes taking turns each time (rows sum them and "
                        "the table adds each run's tr/ar ratio)")
    p.add_argument("--modes", default="tr,ar,serial",
                   help="with --concurrency: the modes to run, of tr, ar, serial, tr-full (batched TR verifying "
                        "every request's whole tree each step: the batch budget off), llama-server and "
                        "llama-server-ngram (llama.cpp's own server, plain and n-gram; `make llama-server`)")
    p.set_defaults(func=_run)


def _instead(p) -> None:
    """The modes that measure something else instead of the decoder comparison."""
    p.add_argument("--profile", action="store_true",
                   help="per-step profile instead: forward cost per width and the time outside the forward, "
                        "for the transformers and the native forward (bench-results/profile.json)")
    p.add_argument("--fidelity", action="store_true",
                   help="fidelity to the exact model instead: the int8 arithmetic and bfloat16 teacher-forced over "
                        "the exact model's greedy continuations of held-out prompts (top-1 agreement, KL; "
                        "bench-results/fidelity.json)")
    p.add_argument("--structured", action="store_true",
                   help="structured output instead: the bundled JSON Schema extraction set under ar, tr and tr without "
                        "grammar-aware drafting, one request at a time (bench-results/structured.json)")
    p.add_argument("--agent", action="store_true",
                   help="the agent workload instead: the bundled tool-calling conversations (core/data/agent/), each "
                        "call run locally and its result fed back, under tr and ar, ids compared on every turn; "
                        "--prompts: another task file (bench-results/agent.json)")
    p.add_argument("--fair-prefill", action="store_true",
                   help="the fairness workload instead: a real `trserve serve`, three concurrent scoring completions "
                        "of a 3,236-token prompt from one tenant and another tenant's short chat beside them; the "
                        "bystander's time to first token (bench-results/fair_prefill.json)")
    p.add_argument("--files", action="store_true", help="GGUF files users bring instead, beside llama-bench "
                   "(bench/files.py; bench-results/files.json)")


def prompts_of(args) -> str:
    """--prompts when given, else the bundled file of --workload."""
    return args.prompts or str(prompt_file(args.workload))


def _run(args) -> int:
    if args.profile:
        from .profile import ProfileConfig, run_profile

        run_profile(ProfileConfig(prompts=prompts_of(args), max_new_tokens=min(args.max_new_tokens, 64),
                                  kernels=args.kernels, arithmetic=args.arithmetic,
                                  threads=args.threads, json_path=args.json or "bench-results/profile.json",
                                  model=args.model))
        return 0
    if args.fidelity:
        from .fidelity import FidelityConfig, run_fidelity

        run_fidelity(FidelityConfig(prompts=prompts_of(args), threads=args.threads, model=args.model,
                                    quantize=args.quantize,
                                    json_path=args.json or "bench-results/fidelity.json"))
        return 0
    if args.structured:
        from .structured import StructuredConfig, run_structured

        run_structured(StructuredConfig(prompts=args.prompts or str(prompt_file("structured")), kernels=args.kernels,
                                        arithmetic=args.arithmetic, threads=args.threads,
                                        json_path=args.json or "bench-results/structured.json", model=args.model))
        return 0
    if args.agent:
        return _run_agent(args)
    if args.files:
        from .files import FilesConfig, run_files

        run_files(FilesConfig(files=(args.model,) if args.model else (), threads=args.threads,
                              arithmetic=args.arithmetic, json_path=args.json or "bench-results/files.json"))
        return 0
    if args.fair_prefill:
        from .fair_prefill import FairPrefillConfig, run_fair_prefill

        run_fair_prefill(FairPrefillConfig(arithmetic=args.arithmetic, threads=args.threads, model=args.model,
                                           json_path=args.json or "bench-results/fair_prefill.json"))
        return 0
    if args.concurrency:
        return _run_concurrency(args)
    from .runner import BenchConfig, run_bench

    config = BenchConfig(
        prompts=prompts_of(args), per_category=args.per_category, max_new_tokens=args.max_new_tokens,
        decoders=tuple(d.strip() for d in args.decoders.split(",") if d.strip()), tree=args.tree,
        first_turn_only=args.first_turn_only, pld_tokens=args.pld_tokens, model=args.model,
        threads=args.threads, kernels=args.kernels, arithmetic=args.arithmetic, quantize=args.quantize,
        json_path=args.json or "bench-results/bench.json",
        temperature=args.temperature, forward=args.forward, gguf=args.gguf, warm_per_category=args.warm_per_category,
    )
    run_bench(config)
    return 0


def _run_agent(args) -> int:
    """The agent workload; exit status 1 where tr's ids differ from ar's on any turn."""
    import sys

    from .agent import AgentConfig, run_agent

    path = args.json or "bench-results/agent.json"
    report = run_agent(AgentConfig(tasks=args.prompts or str(agent_file()), max_new_tokens=args.max_new_tokens,
                                   kernels=args.kernels, arithmetic=args.arithmetic, threads=args.threads,
                                   json_path=path, model=args.model))
    if report["mismatches"]:
        print(f"trserve bench --agent: LOSSLESS CHECK FAILED, tr's ids differ from ar's on "
              f"{len(report['mismatches'])} turns ({path} lists them)", file=sys.stderr)
        return 1
    return 0


def _run_concurrency(args) -> int:
    from .concurrency import ConcurrencyConfig, run_concurrency

    repetitive = args.workload == "repetitive"  # its repetition is in turn 2 and across a tenant's requests
    if args.model and not args.model.endswith(".gguf") and "llama-server" in args.modes:
        raise SystemExit(f"trserve bench: the llama-server modes run a GGUF file; --model {args.model!r} is not one")
    config = ConcurrencyConfig(
        prompts=prompts_of(args), levels=tuple(int(x) for x in args.concurrency.split(",") if x.strip()),
        max_new_tokens=args.max_new_tokens, kernels=args.kernels, arithmetic=args.arithmetic, threads=args.threads,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        json_path=args.json or "bench-results/concurrency.json",
        all_turns=repetitive and not args.first_turn_only, tenant_per_category=repetitive, repeats=args.repeats,
        model=args.model,
    )
    run_concurrency(config)
    return 0
