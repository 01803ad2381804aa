"""The verifier worker: the Generate gRPC API around one Decoder (see server.create_server)."""
