"""trserve: lossless speculative decoding with Token Recycling, as a gRPC service.

    core/          what everything needs: domain errors, tenants, model identity, prompt sets
    engine/        pure decoding (no grpc, no redis): the TR algorithm, the model, the decode loop
    matrix_store/  versioned per-tenant matrices and histories, Redis snapshots (no grpc, no torch)
    services/      thin gRPC (and OpenAI HTTP) servers and clients, the CLI
    bench/         `trserve bench` and the concurrency bench
    v1/            the gRPC code generated from protos/ at build time (`make proto`), not in git

Importing this package loads nothing.
"""
