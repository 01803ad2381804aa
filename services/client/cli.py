"""`trserve generate`: send one prompt to a running worker, print the text and a stats line. The
calls go through the Python client, trserve_client (clients/python): `Client` for one address,
`BalancedClient` for several, a token or TLS."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a running trserve",
                       description="Send a prompt (as one user chat message unless --raw) and print the answer; "
                                   "a one-line stats summary goes to stderr.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--addr", default="127.0.0.1:50051",
                   help="worker address HOST:PORT, or a comma list spread round robin with retry (default 127.0.0.1:50051)")
    p.add_argument("--token-file", default=None, help="file holding this tenant's bearer token (workers with --tenant-tokens)")
    p.add_argument("--tls-ca", default=None, help="CA certificate to trust, for workers serving TLS")
    p.add_argument("--allow-plaintext-token", action="store_true",
                   help="send the --token-file token without TLS to a non-loopback address (trusted networks only)")
    p.add_argument("--tenant", default="", help="tenant whose matrix drafts (default: the server's, 'default')")
    p.add_argument("--domain", default=None, help="domain a new tenant's matrix starts from")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--json", action="store_true",
                   help="print the full response as JSON (with --stream: one JSON object per message)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="most tokens to generate (default: the server's)")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--mode", choices=("tr", "ar"), default=None,
                   help="tr (Token Recycling, default) or ar (plain, one token per step)")
    p.add_argument("--tree", default="", help="draft tree template (default: the server's)")
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 = lossless sampling")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus mass in (0, 1] when sampling (default: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens when sampling (default: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same text (default: random)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import grpc


    if args.raw:
        kwargs = {"prompt": args.prompt}
    else:
        kwargs = {"messages": [{"role": "user", "content": args.prompt}]}
    kwargs.update(tenant=args.tenant, domain=args.domain, max_new_tokens=args.max_new_tokens, stop=args.stop,
                  mode=args.mode, tree=args.tree, return_token_ids=args.json, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    with _client(args) as client:
        try:
            return _stream(client, kwargs, args.json) if args.stream else _unary(client, kwargs, args.json)
        except grpc.RpcError as e:
            print(_error_line(e, args.addr), file=sys.stderr)
            return 1


def _client(args):
    """One plain channel, or the balanced client when several workers, a token or TLS are given."""
    from trserve_client import BalancedClient, Client

    addrs = [a.strip() for a in args.addr.split(",") if a.strip()]
    if len(addrs) == 1 and not args.token_file and not args.tls_ca:
        return Client(addrs[0], timeout=args.timeout)
    from pathlib import Path

    try:
        tokens = {args.tenant or "default": Path(args.token_file).read_text().strip()} if args.token_file else None
    except OSError as e:
        raise SystemExit(f"error: cannot read the token file {args.token_file!r}: {e.strerror}") from None
    try:
        return BalancedClient(addrs, timeout=args.timeout, tokens=tokens, tls_ca_file=args.tls_ca,
                              allow_plaintext_token=args.allow_plaintext_token)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _unary(client, kwargs: dict, as_json: bool) -> int:
    reply = client.generate(**kwargs)
    if as_json:
        print(_to_json(reply.raw))
    else:
        print(reply.text)
        print(stats_line(reply.finish_reason, reply.stats), file=sys.stderr)
    return 0


def _stream(client, kwargs: dict, as_json: bool) -> int:
    last = None
    for chunk in client.stream(**kwargs):
        if as_json:
            print(_to_json(chunk.raw, one_line=True), flush=True)
        else:
            print(chunk.text, end="", flush=True)
        last = chunk
    if not as_json:
        print()
        if last is not None:
            print(stats_line(last.finish_reason, last.raw.stats), file=sys.stderr)
    return 0


def stats_line(finish_reason: str | None, stats) -> str:
    """The stats summary; `finish_reason` as the client's replies give it ("length", None: unspecified)."""
    reason = finish_reason or "unspecified"
    version = f"v{stats.matrix_version}" if stats.HasField("matrix_version") else "-"
    seconds = (stats.prefill_ms + stats.decode_ms) / 1e3
    return (f"[{stats.generated_tokens} tokens in {seconds:.2f} s, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.steps} steps, MAT {stats.mean_accepted_tokens:.2f}, finish {reason}, "
            f"prompt {stats.prompt_tokens} tokens, matrix {version} ({stats.draft_mode}), tree {stats.tree}]")


def _to_json(message, one_line: bool = False) -> str:
    from google.protobuf.json_format import MessageToJson

    text = MessageToJson(message, preserving_proto_field_name=True, indent=None if one_line else 2)
    return text.replace("\n", " ") if one_line else text


def _error_line(e, addr: str) -> str:
    import grpc

    code = e.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"error: cannot reach trserve at {addr} ({e.details()}); is `trserve serve` running there?"
    return f"error: {code.name}: {e.details()}"
