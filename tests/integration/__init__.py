"""End-to-end tests: the CLI and Python API, real S3 (SeaweedFS), real trained models, crashes and resumes."""
