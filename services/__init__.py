"""Ray Serve and gRPC adapters around the eagle2 core (one module per deployment)."""

import eagle2  # noqa: F401  (first: it sets passive OpenMP waiting before torch loads)
