"""Ray Serve and gRPC adapters around the eagle2 core (one module per deployment)."""
