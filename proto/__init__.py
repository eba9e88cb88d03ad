"""The operator API (gRPC / protobuf): operator.proto and its generated stubs (README.md)."""
