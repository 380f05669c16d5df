"""Object storage: ``s3://`` locations for data and checkpoints (``storage.SCHEMES``), and a
local S3 server with injected faults for the tests and the benchmark."""
