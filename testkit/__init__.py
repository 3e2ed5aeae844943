"""Test and benchmark support shared by tests/ and bench/ (neither imports the other's helpers):
synthetic Hugging Face-layout checkpoints (:mod:`testkit.synth`), the MiniLM family
(:mod:`testkit.minilm`), the SeaweedFS S3 server (:mod:`testkit.s3support`), dense reference
merges (:mod:`testkit.dense_reference`, :mod:`testkit.mergekit_reference`) and tensor
comparisons (:mod:`testkit.tensors`). Not shipped (like bench/); imports only the core.
"""
