"""Reproducible throughput and latency runs; each writes its figures under benchmarks/results/."""
