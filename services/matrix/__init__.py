"""The matrix service: a grpc.aio server around matrix_store.MatrixStore (server.py, servicer.py),
server-side remote draft sessions (sessions.py) and its CLI (cli.py). It needs no torch
(tests/services/matrix/test_no_torch.py). The proto conversion it shares with its clients is
services/common/matrix_convert.py; the worker-side clients live in services/worker/drafting/.
Generated protobuf code comes from `make proto` (build/proto/trserve/v1/matrix_pb2*.py)."""
