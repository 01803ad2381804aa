"""trserve: lossless speculative decoding with Token Recycling, as a gRPC service.

The repository's root is the package: each code folder X/ is trserve.X, at the same path.

    core/          what everything needs: domain errors, tenants, model identity, prompt sets
    engine/        pure decoding (no grpc, no redis): the TR algorithm, drafting (engine/drafting/), the model,
                   the decode loop
    matrix_store/  versioned per-tenant matrices and histories, Redis snapshots (no grpc, no torch)
    services/      thin gRPC (and OpenAI HTTP) servers and clients, the whole `trserve` command (services/cli.py)
    bench/         `trserve bench` (and the concurrency bench) and `trserve tune`

The gRPC code generated from protos/ (trserve.v1) is built into build/proto/ (`make proto`), not in git.
Importing this package loads nothing.
"""
