"""trserve: lossless speculative decoding with Token Recycling, as a gRPC service.

    core/          what everything needs: domain errors, tenants, model identity, prompt sets
    engine/        pure decoding (no grpc, no redis): the TR algorithm, the model, the decode loop
    matrix_store/  versioned per-tenant matrices and histories, Redis snapshots (no grpc, no torch)
    services/      thin gRPC (and OpenAI HTTP) servers and clients, the services' commands
    bench/         `trserve bench` (and the concurrency bench) and `trserve tune`
    cli.py         the whole `trserve` command: the services' commands, bench and tune
    v1/            the gRPC code generated from protos/ at build time (`make proto`), not in git

Importing this package loads nothing.
"""
