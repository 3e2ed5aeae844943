"""Kueue integration: queue labels, Queued Jobs, and the io-budget AdmissionCheck controller."""
