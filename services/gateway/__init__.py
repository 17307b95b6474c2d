"""valora gateway: the public gRPC endpoint (inference + admin), auth, validation, deadlines."""
