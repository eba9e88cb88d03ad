"""The operator API (gRPC / protobuf): operator.proto and its generated stubs (issue 16)."""
